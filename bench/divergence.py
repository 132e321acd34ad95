"""Fused divergence kernel vs the eager reference and Liger-Kernel, fwd+bwd, fp32 on CPU.

Each variant runs in a fresh subprocess (so peak memory is its own): inputs are built, the kernel runs
once to warm up (Liger compiles then), the page-resident high-water mark is reset, and one fwd+bwd is
timed. Peak memory = resident high-water mark during the timed step minus the resident size before it
(i.e. memory above the inputs). Liger's `LigerFusedLinearJSDLoss` (β=1, soft loss only) is the peer;
install it with `pip install --no-deps liger-kernel` (bench-only).

    python bench/divergence.py [--sizes 1024 4096 8192 16384] [--chunk 256]
    python bench/divergence.py --cross-tokenizer --chunk 512   # a teacher of another vocabulary
    python bench/divergence.py --ensembles --chunk 512 --repeats 2   # K teachers a token, each method
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from memory import reset_peak, rss_bytes

VOCAB, HIDDEN = 49152, 576
LIGER_DEFAULT_CHUNK = 1024  # LigerFusedLinearJSDLoss's own default chunk_size
MEM_LIMIT_GIB = 20.0


def run_variant(
    variant: str, num_tokens: int, chunk: int, teachers: int, dtype_name: str = "float32"
) -> dict[str, float]:
    import torch

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    hs = (torch.randn(num_tokens, HIDDEN) * 0.5).to(dtype).requires_grad_()
    ws = (torch.randn(VOCAB, HIDDEN) * 0.04).to(dtype).requires_grad_()
    index = torch.randint(0, teachers, (num_tokens,))
    hidden = {t: (torch.randn(int((index == t).sum()), HIDDEN) * 0.5).to(dtype) for t in range(teachers)}
    heads = {t: (torch.randn(VOCAB, HIDDEN) * 0.04).to(dtype) for t in range(teachers)}

    if variant in ("fused", "fused-compiled"):
        from mopd.train.kernel.divergence import linear_divergence

        compiled = variant == "fused-compiled"

        def step() -> None:
            out = linear_divergence(hs, ws, hidden, heads, index, chunk_size=chunk, compiled=compiled)
            out.loss.backward()
    elif variant == "gemms":
        # The fused kernel's floor: its four GEMMs per chunk (student and teacher logits, both
        # gradients), on buffers of its shapes, and nothing else.
        assert teachers == 1 and dtype == torch.float32
        logits = torch.empty(chunk, VOCAB)
        teacher_logits = torch.empty(chunk, VOCAB)
        grad_ws = torch.zeros(VOCAB, HIDDEN)

        def step() -> None:
            grad_hs = torch.empty(num_tokens, HIDDEN)
            with torch.no_grad():
                for start in range(0, num_tokens, chunk):
                    rows = slice(start, start + chunk)
                    size = hs[rows].shape[0]
                    torch.mm(hs[rows], ws.T, out=logits[:size])
                    torch.mm(hidden[0][rows], heads[0].T, out=teacher_logits[:size])
                    grad_hs[rows] = logits[:size] @ ws
                    grad_ws.addmm_(logits[:size].T, hs[rows])
    elif variant == "projected":
        # A teacher of GPT-2's 50,257 tokens projected onto SmolLM2's 49,152 (the real pair's first-token
        # projection, built before the timed step): the same-tokenizer kernel's work plus the teacher's
        # own softmax and the projection's scatter per chunk.
        from mopd.train.kernel.projected import projected_divergence

        assert teachers == 1
        projection = real_projection()
        cross_head = (torch.randn(projection.teacher_vocab, HIDDEN) * 0.04).to(dtype)

        def step() -> None:
            out = projected_divergence(hs, ws, hidden[0], cross_head, projection, chunk_size=chunk)
            out.loss.backward()
    elif variant.startswith("ensemble-"):
        # Every token scored by all `teachers` teachers (a row routed to K of them), combined by the
        # method as `mopd train` does (`train.ensembles.ensemble_loss`, weights 1).
        step = ensemble_step(variant.removeprefix("ensemble-"), hs, ws, heads, teachers, chunk, dtype)
    elif variant == "eager":
        from mopd.train.kernel.reference import reference_divergence

        def step() -> None:
            reference_divergence(hs, ws, hidden, heads, index).loss.backward()
    elif variant.startswith("liger"):
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        assert teachers == 1
        loss_fn = LigerFusedLinearJSDLoss(
            weight_hard_loss=0.0,
            weight_soft_loss=1.0,
            beta=1.0,
            compiled=variant == "liger-compiled",
            chunk_size=chunk,
        )
        labels = torch.randint(0, VOCAB, (num_tokens,))

        def step() -> None:
            loss_fn(hs, ws, hidden[0], heads[0], labels).backward()
    else:
        raise ValueError(variant)

    step()  # warm-up (and compilation)
    hs.grad = ws.grad = None
    reset_peak()  # reset the resident high-water mark
    before = rss_bytes("VmRSS")
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_bytes": rss_bytes("VmHWM") - before}


def ensemble_step(method: str, hs: Any, ws: Any, heads: dict, teachers: int, chunk: int, dtype: Any) -> Any:
    """One fwd+bwd of `method` over N tokens that every one of `teachers` teachers scores."""
    import numpy as np
    import torch

    from mopd.store.format.transform import LogitTransform
    from mopd.train.data.loader import MicroBatch
    from mopd.train.ensembles import ensemble_loss

    n = hs.shape[0]
    mb = MicroBatch(
        rows=np.zeros(1, dtype=np.int64),
        input_ids=torch.zeros(1, n, dtype=torch.long),
        attention_mask=torch.ones(1, n, dtype=torch.long),
        loss_mask=torch.ones(1, n, dtype=torch.bool),
        teacher_index=torch.zeros(n, dtype=torch.long),
        token_row=torch.zeros(n, dtype=torch.long),
        labels=torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(1)),
        teacher_hidden={t: (torch.randn(n, HIDDEN) * 0.5).to(dtype) for t in range(teachers)},
        teacher_set=torch.full((n,), (1 << teachers) - 1, dtype=torch.long),
    )
    settings = dict(kind="reverse_kl", beta=0.5, temperature=1.0, chunk_size=chunk, compiled=False)
    settings |= dict(tp_group=None, vocab_start=0, vocab_size=VOCAB)
    transforms = {t: LogitTransform() for t in range(teachers)}
    norm = torch.full((n,), 1.0 / n)

    def step() -> None:
        out = ensemble_loss(method, hs, ws, mb, norm, torch.ones(teachers), heads, transforms, settings)
        out.loss.backward()

    return step


def ensembles(args: argparse.Namespace) -> None:
    """Each `train.ensemble.method` with K = 1, 2, 4 teachers a token against one routed teacher (the
    fused kernel), N=4096, interleaved repeats, best of each."""
    specs = {"routed, K=1": ("fused", 1)}
    for method in ("mixture", "sum", "min_ce", "confidence"):
        specs |= {f"{method}, K={k}": (f"ensemble-{method}", k) for k in (1, 2, 4)}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in specs}
    for _ in range(args.repeats):
        for name, (variant, k) in specs.items():
            runs[name].append(measure(variant, 4096, args.chunk, k))
            print(f"  {name}: {runs[name][-1]}", flush=True)
    best = {k: min((r for r in v if ok(r)), key=lambda r: r["seconds"]) for k, v in runs.items()}
    write_results(args.out.with_name("divergence-ensembles.json"), chunk=args.chunk, best=best, runs=runs)
    gib, base = 2.0**30, best["routed, K=1"]
    print(f"N=4096, fp32, V={VOCAB}, H={HIDDEN}, chunk {args.chunk}, fwd+bwd, best of {args.repeats}")
    print(f"{'':18s}{'seconds':>9s}{'vs routed':>11s}{'goal':>7s}{'peak GiB':>10s}")
    for name, r in best.items():
        k = specs[name][1]
        print(
            f"{name:18s}{r['seconds']:9.2f}{r['seconds'] / base['seconds']:10.2f}x"
            f"{1 + 0.5 * (k - 1):6.1f}x{r['peak_bytes'] / gib:10.2f}"
        )


def real_projection() -> Any:
    """GPT-2's vocabulary (openai-whisper's assets) onto SmolLM2's, mopd's first-token projection."""
    from transformers import AutoTokenizer

    from mopd.precompute.packaged_models import gpt2_tokenizer, smollm2_checkpoint
    from mopd.tokens.pieces import token_table
    from mopd.tokens.projection import first_token_projection

    gpt2 = AutoTokenizer.from_pretrained(gpt2_tokenizer())
    smol = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    return first_token_projection(token_table(gpt2), smol, token_table(smol))


def cross_tokenizer(args: argparse.Namespace) -> None:
    """A teacher of another vocabulary against one of the student's, N=4096, interleaved repeats."""
    runs: dict[str, list[dict[str, Any]]] = {"fused": [], "projected": []}
    for _ in range(args.repeats):
        for variant in runs:
            runs[variant].append(measure(variant, 4096, args.chunk))
    best = {k: min((r for r in v if ok(r)), key=lambda r: r["seconds"]) for k, v in runs.items()}
    write_results(
        args.out.with_name("divergence-cross-tokenizer.json"), chunk=args.chunk, best=best, runs=runs
    )
    gib = 2.0**30
    same, cross = best["fused"], best["projected"]
    print(f"N=4096, fp32, V=49152 student, H={HIDDEN}, chunk {args.chunk}, fwd+bwd, best of {args.repeats}")
    for name, r in (("same tokenizer (V_t=49152)", same), ("projected (V_t=50257, GPT-2)", cross)):
        print(f"{name + ':':30s}{r['seconds']:.2f} s, {r['peak_bytes'] / gib:.2f} GiB above inputs")
    print(
        f"projected / same: {cross['seconds'] / same['seconds']:.2f}x time, "
        f"{cross['peak_bytes'] / same['peak_bytes']:.2f}x peak extra memory"
    )


def measure(
    variant: str, num_tokens: int, chunk: int, teachers: int = 1, dtype: str = "float32"
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        variant,
        str(num_tokens),
        str(chunk),
        str(teachers),
        dtype,
        "--mem-limit-gib",
        str(MEM_LIMIT_GIB),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["killed"])[-1]
        oom = proc.returncode in (-9, 137) or "alloc" in last.lower() or "memory" in last.lower()
        reason = f"out of memory under the {MEM_LIMIT_GIB:g} GiB cap" if oom else last
        print(f"  {variant} N={num_tokens}: failed ({reason})", file=sys.stderr)
        return {"failed": reason}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ok(result: dict[str, float] | None) -> bool:
    return result is not None and "failed" not in result


def write_results(path: Path, **fields: Any) -> None:
    """The run's figures as JSON, with the shapes and the machine they were measured at."""
    payload = {"vocab": VOCAB, "hidden": HIDDEN, "cpus": os.cpu_count(), **fields}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def chunk_sweep(args: argparse.Namespace) -> None:
    """The default chunk by measurement, and the issue-19 ratios at it (one run, side by side)."""
    default = args.chunk
    n = 8192

    def best(specs: dict[str, tuple[Any, ...]]) -> dict[str, dict[str, Any]]:
        """The fastest of `args.repeats` runs of each spec, the specs alternated run by run: single runs
        drift by up to ±30% on this machine, and alternating puts a slow spell on every side."""
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in specs}
        for _ in range(args.repeats):
            for name, spec in specs.items():
                runs[name].append(measure(*spec))
        return {
            name: min(good, key=lambda r: r["seconds"]) if (good := [r for r in rs if ok(r)]) else rs[0]
            for name, rs in runs.items()
        }

    sweep = {}
    for chunk in args.chunk_sweep:
        sweep[str(chunk)] = best({"fused": ("fused", n, chunk), "gemms": ("gemms", n, chunk)})
        print(f"  chunk {chunk}: {sweep[str(chunk)]}", flush=True)
    at_default = best(
        {
            "fused": ("fused", n, default),
            "gemms": ("gemms", n, default),
            "fused-compiled": ("fused-compiled", n, default),
            "liger-compiled": ("liger-compiled", n, LIGER_DEFAULT_CHUNK),
        }
    )
    print(f"  at the default: {at_default}", flush=True)
    bf16 = {t: measure("fused", 4096, default, t, "bfloat16") for t in (1, 4)}
    write_results(
        args.out,
        tokens=n,
        default_chunk=default,
        liger_chunk=LIGER_DEFAULT_CHUNK,
        repeats=args.repeats,
        sweep=sweep,
        at_default=at_default,
        bf16_n4096_by_teachers=bf16,
    )
    gib = 2.0**30
    print(f"fp32 fwd+bwd, N={n}, V={VOCAB}, H={HIDDEN}: fused / its GEMMs alone, by chunk")
    for chunk, row in sweep.items():
        f, g = row["fused"], row["gemms"]
        if ok(f) and ok(g):
            print(
                f"  {chunk:>5}: {f['seconds']:7.2f} s / {g['seconds']:7.2f} s"
                f" = {f['seconds'] / g['seconds']:.2f}x"
            )
    r = at_default
    if all(ok(v) for v in r.values()):
        fused = r["fused"]["seconds"]
        print(
            f"default chunk {default}: fused {fused:.2f} s = {fused / r['gemms']['seconds']:.2f}x its GEMMs, "
            f"{fused / r['liger-compiled']['seconds']:.2f}x Liger compiled (chunk {LIGER_DEFAULT_CHUNK}); "
            f"compiled chain {r['fused-compiled']['seconds']:.2f} s"
        )
    for t, v in bf16.items():
        if ok(v):
            print(
                f"bf16 inputs, N=4096, {t} teacher(s): peak {v['peak_bytes'] / gib:.2f} GiB above the inputs"
            )
    print(f"wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--variants", nargs="+", default=["eager", "liger-compiled", "fused"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "divergence.json")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the 1-vs-4-teacher comparison")
    parser.add_argument("--mem-limit-gib", type=float, default=20.0, help="per-variant memory cap")
    parser.add_argument(
        "--chunk-sweep",
        type=int,
        nargs="*",
        help="instead: fused and its GEMMs alone at N=8192 over these chunks, then at --chunk (mopd's "
        "default) Liger, the compiled chain, and bf16 inputs with one and four teachers at N=4096",
    )
    parser.add_argument(
        "--cross-tokenizer",
        action="store_true",
        help="instead: a teacher of another vocabulary (projected) against the same-tokenizer kernel",
    )
    parser.add_argument(
        "--ensembles",
        action="store_true",
        help="instead: each ensemble method with 1, 2 and 4 teachers a token against one routed teacher",
    )
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global MEM_LIMIT_GIB
    MEM_LIMIT_GIB = args.mem_limit_gib
    if args.child:
        # An address-space cap turns running out of memory into an error instead of the OOM killer.
        limit = int(args.mem_limit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        variant, n, chunk, teachers, dtype = args.child
        print(json.dumps(run_variant(variant, int(n), int(chunk), int(teachers), dtype)))
        return
    if args.chunk_sweep:
        chunk_sweep(args)
        return
    if args.cross_tokenizer:
        cross_tokenizer(args)
        return
    if args.ensembles:
        ensembles(args)
        return

    results: dict[str, dict[str, dict[str, float] | None]] = {}
    for n in args.sizes:
        results[str(n)] = {v: measure(v, n, args.chunk) for v in args.variants}
    # 1 vs 4 teachers differ by less than this machine's run-to-run drift: interleave, best of each.
    runs: dict[str, list[dict[str, float] | None]] = {"1 teacher": [], "4 teachers": []}
    for _ in range(args.repeats):
        runs["1 teacher"].append(measure("fused", 4096, args.chunk, 1))
        runs["4 teachers"].append(measure("fused", 4096, args.chunk, 4))
    multi = {
        k: min((r for r in v if r is not None and ok(r)), key=lambda r: r["seconds"], default=None)
        for k, v in runs.items()
    }
    write_results(
        args.out,
        dtype="float32",
        chunk=args.chunk,
        torch_threads=os.environ.get("OMP_NUM_THREADS"),
        by_tokens=results,
        multi_teacher=multi,
    )

    gib = 2.0**30
    print(f"fwd+bwd, fp32, V={VOCAB}, H={HIDDEN}, fused chunk {args.chunk}; time s / peak GiB above inputs")
    print(
        f"{'N':>6} "
        + "".join(f"{v:>22}" for v in args.variants)
        + f"{'time vs eager':>15}{'mem vs eager':>14}"
    )
    for n, row in results.items():
        cells = "".join(
            f"{r['seconds']:10.2f}s {r['peak_bytes'] / gib:8.2f}G"
            if r is not None and ok(r)
            else f"{'OOM':>22}"
            for r in row.values()
        )
        fused, eager = row.get("fused"), row.get("eager")
        ratio = (
            f"{fused['seconds'] / eager['seconds']:14.2f}x{eager['peak_bytes'] / fused['peak_bytes']:13.1f}x"
            if fused is not None and eager is not None and ok(fused) and ok(eager)
            else ""
        )
        print(f"{n:>6} {cells}{ratio}")
    one, four = multi["1 teacher"], multi["4 teachers"]
    if one is not None and four is not None and ok(one) and ok(four):
        print(
            f"N=4096, 4 teachers mixed vs 1: {four['seconds'] / one['seconds']:.2f}x time, "
            f"{four['peak_bytes'] / gib:.2f} vs {one['peak_bytes'] / gib:.2f} GiB"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

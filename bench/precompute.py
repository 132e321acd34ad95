"""`mopd precompute` on SmolLM2-135M (CPU): store overhead, and the vllm backend against the hf one.

Measures, in one run and on the same rows and batches: (a) the hf teacher forward alone (hidden states
captured, nothing written), (b) the full hidden-state tasks with the hf backend (forward + bf16
conversion + finite check + store writes, fsync, publish, hashing, part records), (c) the same tasks
with the vllm backend (skipped with `--backends hf`). Repeats are interleaved; each backend loads once,
before the timed repeats (load times are reported apart). Two overhead figures for the hf backend:

- in-run: wall time of (b) spent outside the forward calls, over the forward time of (b). Exact, since
  both sides come from the same run; it does not see the forward slowed by background compression.
- A/B: (best b − best a) / best a over interleaved repeats. Sees everything, but this machine's speed
  drifts by several percent between runs, so it resolves only differences larger than that.

Target ≤ 5% (the store's writes overlap the forward). Backends: tokens/s of (b) and (c), best repeat
each, and their ratio. Prints a table, writes bench/results/precompute.json.

    python bench/precompute.py [--rows 64] [--length 512] [--backends hf vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from mopd.base.batching import pack_batches
from mopd.config.mopd_config import MopdConfig, parse_config
from mopd.precompute.backends import HiddenStateSource
from mopd.precompute.hf_backend import HFTeacher
from mopd.precompute.outputs import StoreOutput
from mopd.precompute.packaged_models import smollm2_checkpoint
from mopd.precompute.progress import TokenProgress
from mopd.precompute.rows import TokenizedRows
from mopd.precompute.runner import build_plan, run_hidden_task
from mopd.precompute.teachers import TeacherSet, resolve_teachers
from mopd.store.writer import StoreWriter


def forward_only(teacher: HiddenStateSource, rows: TokenizedRows, batch_tokens: int) -> float:
    ids = np.arange(rows.num_rows)
    start = time.perf_counter()
    for batch in pack_batches(ids, rows.lengths, batch_tokens=batch_tokens):
        for states in teacher.hidden_states([rows.input_ids[r] for r in batch]):
            states.to(torch.bfloat16)
    return time.perf_counter() - start


class TimedTeacher:
    """The teacher with its forward calls timed."""

    def __init__(self, teacher: HiddenStateSource) -> None:
        self._teacher = teacher
        self.checkpoint = teacher.checkpoint
        self.hidden_size = teacher.hidden_size
        self.forward_s = 0.0

    def hidden_states(self, rows: list[np.ndarray]) -> list[torch.Tensor]:
        start = time.perf_counter()
        out = self._teacher.hidden_states(rows)
        self.forward_s += time.perf_counter() - start
        return out


def with_store(
    teacher: HiddenStateSource,
    backend: str,
    rows: TokenizedRows,
    config: MopdConfig,
    teachers: TeacherSet,
    root: Path,
) -> tuple[float, float]:
    """(wall seconds, seconds of it inside the forward)."""
    plan = build_plan(config, teachers, rows, backend, "float32")
    output = StoreOutput(StoreWriter.open(root, plan), config.store.dtype)
    timed = TimedTeacher(teacher)
    start = time.perf_counter()
    with TokenProgress(total_rows=rows.num_rows, total_tokens=int(rows.lengths.sum()), enabled=False) as p:
        for task in plan.tasks:
            if task.kind == "hidden":
                run_hidden_task(output, task, timed, rows, config.precompute.batch_tokens, p)
    return time.perf_counter() - start, timed.forward_s


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", nargs="+", choices=["hf", "vllm"], default=["hf", "vllm"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "precompute.json")
    args = parser.parse_args()

    checkpoint = smollm2_checkpoint()
    work = Path(tempfile.mkdtemp(prefix="mopd-bench-"))
    config = parse_config(
        {
            "teachers": {"smol": str(checkpoint)},
            "data": {"path": "bench"},
            "store": {"dtype": "bfloat16"},
            "precompute": {"rows_per_task": 16, "batch_tokens": args.batch_tokens},
        },
        base_dir=work,
    )
    teachers = resolve_teachers(config.teachers, config.tokenizer)
    rng = np.random.default_rng(0)
    rows = TokenizedRows.from_lists(
        [rng.integers(0, 49152, size=args.length) for _ in range(args.rows)],
        [np.ones(args.length, np.uint8) for _ in range(args.rows)],
        teacher_index=np.zeros(args.rows, dtype=np.int64),
        source_keys=[str(i) for i in range(args.rows)],
    )
    loaded, load_s = {}, {}
    for backend in ["hf", *[b for b in args.backends if b != "hf"]]:  # hf is the overhead baseline
        start = time.perf_counter()
        loaded[backend] = load_bench_teacher(backend, str(checkpoint), args.length, args.batch_tokens)
        load_s[backend] = time.perf_counter() - start
        warm = [rows.input_ids[0][:64], rows.input_ids[1][:32]]
        loaded[backend].hidden_states(warm)
    forward_s: list[float] = []
    store_s: dict[str, list[float]] = {backend: [] for backend in loaded}
    inner_forward_s: dict[str, list[float]] = {backend: [] for backend in loaded}
    try:
        for rep in range(args.repeats):
            forward_s.append(forward_only(loaded["hf"], rows, args.batch_tokens))
            for backend, teacher in loaded.items():
                root = work / f"store-{backend}-{rep}.zarr"
                wall, inner = with_store(teacher, backend, rows, config, teachers, root)
                store_s[backend].append(wall)
                inner_forward_s[backend].append(inner)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens = args.rows * args.length
    best_forward, best_store = min(forward_s), min(store_s["hf"])
    overhead = (best_store - best_forward) / best_forward
    in_run = [
        (wall - inner) / inner for wall, inner in zip(store_s["hf"], inner_forward_s["hf"], strict=True)
    ]
    tokens_per_s = {backend: tokens / min(times) for backend, times in store_s.items()}
    result = {
        "model": "SmolLM2-135M-Instruct (fp32 compute, bf16 store)",
        "rows": args.rows,
        "length": args.length,
        "tokens": tokens,
        "batch_tokens": args.batch_tokens,
        "cpus": os.cpu_count(),
        "forward_only_s": forward_s,
        "with_store_s": store_s["hf"],
        "forward_inside_store_run_s": inner_forward_s["hf"],
        "store_overhead_in_run": max(in_run),
        "store_overhead_ab": overhead,
        "tokens_per_s_with_store": tokens_per_s["hf"],
        "backends": {
            backend: {"load_s": load_s[backend], "with_store_s": store_s[backend], "tokens_per_s": tps}
            for backend, tps in tokens_per_s.items()
        },
    }
    if "vllm" in tokens_per_s:
        result["vllm_vs_hf_tokens_per_s"] = tokens_per_s["vllm"] / tokens_per_s["hf"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"SmolLM2-135M, {args.rows} rows x {args.length} tokens, batches of {args.batch_tokens} tokens")
    print(f"{'':34}{'seconds':>9}{'tok/s':>9}{'load s':>9}")
    print(f"{'hf teacher forward only':34}{best_forward:9.2f}{tokens / best_forward:9.0f}")
    for backend, tps in tokens_per_s.items():
        label = f"{backend}: forward + store writes"
        print(f"{label:34}{min(store_s[backend]):9.2f}{tps:9.0f}{load_s[backend]:9.1f}")
    print(f"hf store overhead in-run (worst repeat): {max(in_run) * 100:.2f}% of the forward (target <= 5%)")
    print(
        f"hf store overhead A/B (best of {args.repeats} each): {overhead * 100:+.1f}% (with run-to-run drift)"
    )
    if "vllm" in tokens_per_s:
        print(f"vllm vs hf, tokens/s with the store: {result['vllm_vs_hf_tokens_per_s']:.2f}x")
    print(f"wrote {args.out}")


def load_bench_teacher(backend: str, checkpoint: str, length: int, batch_tokens: int) -> HiddenStateSource:
    if backend == "hf":
        return HFTeacher(checkpoint, device="cpu", dtype="float32")
    from mopd.precompute.vllm_backend import VLLMTeacher

    return VLLMTeacher(
        checkpoint, max_model_len=length, batch_tokens=batch_tokens, device="cpu", dtype="float32"
    )


if __name__ == "__main__":
    main()

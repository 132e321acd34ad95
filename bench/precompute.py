"""Store overhead of `mopd precompute` relative to the teacher forward itself (SmolLM2-135M, CPU).

Measures, in one run and on the same rows and batches: (a) the teacher forward alone (hidden states
captured, nothing written), (b) the full hidden-state tasks (forward + bf16 conversion + finite check +
store writes, fsync, publish, hashing, part records). Two overhead figures:

- in-run: wall time of (b) spent outside the forward calls, over the forward time of (b). Exact, since
  both sides come from the same run; it does not see the forward slowed by background compression.
- A/B: (best b − best a) / best a over interleaved repeats. Sees everything, but this machine's speed
  drifts by several percent between runs, so it resolves only differences larger than that.

Target ≤ 5% (the store's writes overlap the forward). Prints a table, writes bench/results/precompute.json.

    python bench/precompute.py [--rows 64] [--length 512]
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

from mopd.precompute.data import TokenizedRows
from mopd.precompute.hf_backend import HFTeacher
from mopd.precompute.packaged_models import smollm2_checkpoint
from mopd.precompute.progress import TokenProgress
from mopd.precompute.runner import build_plan, run_hidden_task
from mopd.precompute.teachers import TeacherSet, resolve_teachers
from mopd.store.batching import pack_batches
from mopd.store.config import MopdConfig, parse_config
from mopd.store.writer import StoreWriter


def forward_only(teacher: HFTeacher, rows: TokenizedRows, batch_tokens: int) -> float:
    ids = np.arange(rows.num_rows)
    start = time.perf_counter()
    for batch in pack_batches(ids, rows.lengths, batch_tokens=batch_tokens):
        for states in teacher.hidden_states([rows.input_ids[r] for r in batch]):
            states.to(torch.bfloat16)
    return time.perf_counter() - start


class TimedTeacher:
    """The teacher with its forward calls timed."""

    def __init__(self, teacher: HFTeacher) -> None:
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
    teacher: HFTeacher, rows: TokenizedRows, config: MopdConfig, teachers: TeacherSet, root: Path
) -> tuple[float, float]:
    """(wall seconds, seconds of it inside the forward)."""
    plan = build_plan(config, teachers, rows, "hf", "float32")
    writer = StoreWriter.open(root, plan)
    timed = TimedTeacher(teacher)
    start = time.perf_counter()
    with TokenProgress(total_rows=rows.num_rows, total_tokens=int(rows.lengths.sum()), enabled=False) as p:
        for task in plan.tasks:
            if task.kind == "hidden":
                run_hidden_task(writer, task, timed, rows, config, p)
    return time.perf_counter() - start, timed.forward_s


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
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
    teachers = resolve_teachers(config)
    rng = np.random.default_rng(0)
    rows = TokenizedRows(
        input_ids=[rng.integers(0, 49152, size=args.length) for _ in range(args.rows)],
        loss_mask=[np.ones(args.length, np.uint8) for _ in range(args.rows)],
        agents=["smol"] * args.rows,
        source_keys=[str(i) for i in range(args.rows)],
        teacher_index=np.zeros(args.rows, dtype=np.int64),
        input_format="input_ids",
    )
    teacher = HFTeacher(str(checkpoint), device="cpu", dtype="float32")
    forward_only(teacher, TokenizedRows(rows.input_ids[:2], rows.loss_mask[:2], [], [], np.zeros(2)), 1024)
    forward_s, store_s, inner_forward_s = [], [], []
    try:
        for rep in range(args.repeats):
            forward_s.append(forward_only(teacher, rows, args.batch_tokens))
            wall, inner = with_store(teacher, rows, config, teachers, work / f"store-{rep}.zarr")
            store_s.append(wall)
            inner_forward_s.append(inner)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens = args.rows * args.length
    best_forward, best_store = min(forward_s), min(store_s)
    overhead = (best_store - best_forward) / best_forward
    in_run = [(wall - inner) / inner for wall, inner in zip(store_s, inner_forward_s, strict=True)]
    result = {
        "model": "SmolLM2-135M-Instruct (fp32 compute, bf16 store)",
        "rows": args.rows,
        "length": args.length,
        "tokens": tokens,
        "batch_tokens": args.batch_tokens,
        "cpus": os.cpu_count(),
        "forward_only_s": forward_s,
        "with_store_s": store_s,
        "forward_inside_store_run_s": inner_forward_s,
        "store_overhead_in_run": max(in_run),
        "store_overhead_ab": overhead,
        "tokens_per_s_with_store": tokens / best_store,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"SmolLM2-135M, {args.rows} rows x {args.length} tokens, batches of {args.batch_tokens} tokens")
    print(f"{'':26}{'seconds':>9}{'tok/s':>9}")
    print(f"{'teacher forward only':26}{best_forward:9.2f}{tokens / best_forward:9.0f}")
    print(f"{'forward + store writes':26}{best_store:9.2f}{tokens / best_store:9.0f}")
    print(f"store overhead in-run (worst repeat): {max(in_run) * 100:.2f}% of the forward (target <= 5%)")
    print(f"store overhead A/B (best of {args.repeats} each): {overhead * 100:+.1f}% (with run-to-run drift)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

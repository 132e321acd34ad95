"""Two real teachers scoring every row, against routing each row to one of them (issue 49, item 5).

Teachers: SmolLM2-135M-Instruct (the packaged checkpoint) and its first 16 blocks (the quickstart's
`code` teacher); student: the quickstart's (its first 4 blocks); rows: the quickstart's three-agent
dataset. Two stores from one dataset: **single** routes math and chat rows to the whole model and code
rows to the cut (the quickstart's routing), **both** routes every row to both. Three runs of the same
steps, seed and held-out rows: single-teacher routing on the first store, `mixture` and `min_ce` on the
second. Reported: each run's step time (median over the steps after the first two; K = 2 teachers a token
against K = 1), and each trained student's held-out divergence (reverse KL per trained token) to each
teacher and to their equal-weight mixture, on the same held-out rows (evaluated on the second store with
`sum`, which reports each teacher's own divergence, and with `mixture`).

    python bench/ensemble.py [--steps 40]     # ~15 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO.parent))

AGENTS = ("math", "code", "chat")
ROUTINGS = {
    "single": {"math": "big", "code": "small", "chat": "big"},
    "both": {agent: ["big", "small"] for agent in AGENTS},
}
EVAL_ROWS = [24]  # held-out rows (--eval-rows)
RUNS = {"single routing": ("single", "mixture"), "mixture": ("both", "mixture"), "min_ce": ("both", "min_ce")}


def config(
    work: Path, store: str, *, steps: int, method: str, student: str | None = None, name: str = "train"
) -> Path:
    from mopd.cli.quickstart_assets import BIG_TEACHER, SMALL_TEACHER, STUDENT

    raw = {
        "teachers": {"big": f"models/{BIG_TEACHER}", "small": f"models/{SMALL_TEACHER}"},
        "routing": {"field": "agent", "teacher_by_agent": ROUTINGS[store]},
        "data": {"path": "data.jsonl", "max_length": 160},
        "store": {"path": f"{store}.zarr", "dtype": "bfloat16"},
        "precompute": {"batch_tokens": 4096, "rows_per_task": 64},
        "train": {
            "student": student or f"models/{STUDENT}",
            "steps": steps,
            "optim": {"lr": 3.0e-3, "warmup_steps": 5},
            "batch": {"micro_batch_tokens": 2048, "global_batch_tokens": 1024},
            "divergence": {"kind": "reverse_kl", "chunk_size": 512},
            "ensemble": {"method": method},
            "lm_head_lifecycle": "none",
            "eval": {"rows": EVAL_ROWS[0], "every": 0},
            "checkpoint": {"every": steps, "keep": 1},
            "output_dir": f"run-{store}-{method}",
        },
    }
    path = work / f"{store}-{method}-{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def held_out(work: Path, student: str, steps: int) -> dict[str, float]:
    """The student's held-out reverse KL to each teacher (`sum`) and to their mixture, on the `both`
    store's held-out rows (the rows every run held out: same count, seed and row order)."""
    from mopd.config.mopd_config import load_config
    from mopd.train.session import open_session
    from mopd.train.trainer import held_out_rows

    out: dict[str, float] = {}
    for method in ("sum", "mixture"):
        loaded = load_config(config(work, "both", steps=steps, method=method, student=student, name="eval"))
        with open_session(loaded, log=lambda _line: None) as session:
            rows = held_out_rows(session.store.num_rows, EVAL_ROWS[0], loaded.train.seed)
            record = session.evaluate(rows, step=0)
            names = {str(t.index): t.aliases[0] for t in session.store.manifest.teachers}
        for key, value in record["divergence_by_teacher"].items():
            out[names.get(key, "ensemble")] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rows-per-agent", type=int, default=48)
    parser.add_argument("--eval-rows", type=int, default=24)
    parser.add_argument("--work", type=Path, default=Path("/tmp/mopd-bench-ensemble"))
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ensemble.json")
    args = parser.parse_args()

    from mopd.cli.quickstart_assets import STUDENT, prepare_models, write_dataset
    from mopd.config.mopd_config import load_config
    from mopd.precompute.runner import run_precompute
    from mopd.train.trainer import run_training

    work = args.work
    EVAL_ROWS[0] = args.eval_rows
    work.mkdir(parents=True, exist_ok=True)
    for old in [*work.glob("*.zarr"), *work.glob("run-*")]:  # a fresh store and run each time (timed)
        shutil.rmtree(old)
    prepare_models(work, log=lambda _line: None)
    write_dataset(work / "data.jsonl", args.rows_per_agent)
    precompute_s = {}
    for store in ROUTINGS:
        start = time.perf_counter()
        run_precompute(
            load_config(config(work, store, steps=args.steps, method="mixture")), log=lambda *_: None
        )
        precompute_s[store] = time.perf_counter() - start
    results: dict[str, Any] = {"untrained": held_out(work, f"models/{STUDENT}", args.steps)}
    for name, (store, method) in RUNS.items():
        run = run_training(
            load_config(config(work, store, steps=args.steps, method=method)), log=lambda _: None
        )
        steps = [r["step_seconds"] for r in run.records if r.get("split", "train") == "train"][2:]
        model = work / f"run-{store}-{method}" / "checkpoints" / f"step_{args.steps:08d}" / "model"
        results[name] = {"step_s": statistics.median(steps), **held_out(work, str(model), args.steps)}
        print(f"  {name}: {results[name]}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"steps": args.steps, "precompute_s": precompute_s, **results}, indent=2) + "\n"
    )
    base = results["single routing"]["step_s"]
    print(
        f"{args.steps} steps, held-out reverse KL per trained token ({args.eval_rows} rows); "
        "step time median after step 2"
    )
    print(f"{'':16s}{'step s':>8s}{'vs K=1':>8s}{'to big':>9s}{'to small':>10s}{'to mixture':>12s}")
    for name, r in results.items():
        step = f"{r['step_s']:8.2f}{r['step_s'] / base:7.2f}x" if "step_s" in r else f"{'':16s}"
        print(f"{name:16s}{step}{r['big']:9.3f}{r['small']:10.3f}{r['ensemble']:12.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

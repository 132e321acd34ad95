"""`mopd rollout` and `mopd rounds`."""

from __future__ import annotations

from pathlib import Path

import click

from mopd.cli.arguments import config_argument
from mopd.cli.console import plain_log, stderr_console
from mopd.config.mopd_config import load_config
from mopd.config.paths import ROLLOUT, check_paths, rounds_paths


@click.command("rollout")
@config_argument
@click.option(
    "--student",
    type=click.Path(path_type=Path),
    help="The student that samples: a transformers checkpoint folder (default: train.student; a megatron "
    "run's student after `mopd export-hf`).",
)
@click.option(
    "--output",
    type=click.Path(path_type=Path),
    help="The dataset written, .jsonl or .parquet by its extension (default: rollout.output).",
)
@click.option(
    "--round", "round_index", type=click.IntRange(min=0), default=0, help="The round recorded in the rows."
)
def rollout_command(
    config_path: Path,
    overrides: tuple[str, ...],
    student: Path | None,
    output: Path | None,
    round_index: int,
) -> None:
    """Sample the student's own completions of every prompt of rollout.prompts.

    Writes rows that `mopd precompute` reads: the exact sampled ids (`input_ids`, `loss_mask`), their text
    (`prompt` + `completion`, or `messages` with the new assistant turn), the routing column and the
    provenance of each sample. Resumable: a rerun keeps the parts already written.
    """
    from mopd.rollout.runner import run_rollout  # torch and transformers: not for `mopd --help`

    config = load_config(config_path, overrides)
    check_paths(config, [key for key in ROLLOUT if student is None or key != "train.student"])
    console = stderr_console()
    result = run_rollout(
        config,
        student=str(student) if student is not None else None,
        output=output,
        round_index=round_index,
        log=plain_log(console),
    )
    console.print(
        f"wrote {result.rows:,} samples of {result.prompts:,} prompts to {result.output} "
        f"({result.truncated} cut at max_new_tokens, {result.seconds:.1f} s)"
    )


@click.command("rounds")
@config_argument
def rounds_command(config_path: Path, overrides: tuple[str, ...]) -> None:
    """On-policy distillation in rounds: the student samples, the teachers score, the student trains.

    Round r samples rollout.prompts with the student of round r − 1, precomputes and verifies a store of
    the samples, trains rounds.steps_per_round steps from round r − 1's last checkpoint and exports the
    student; with rounds.heldout_prompts, each round's held-out divergence per teacher on the student's
    own samples goes to WORKDIR/rounds.jsonl and WORKDIR/heldout.png. One process. Rerun after a crash:
    it continues from the first unfinished stage.
    """
    from mopd.rollout.rounds import run_rounds

    config = load_config(config_path, overrides)
    check_paths(config, rounds_paths(config))
    console = stderr_console()
    run = run_rounds(config, log=plain_log(console))
    console.print(f"rounds done; last run {run}")

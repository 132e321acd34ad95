"""`mopd verify-manifest` and `mopd inspect`."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from pathlib import Path

import click
from rich import box
from rich.console import Console
from rich.table import Table

from mopd.base.errors import MopdError
from mopd.cli.arguments import STORE
from mopd.config.mopd_config import load_config
from mopd.config.paths import teachers_as_found
from mopd.store.format.loading import read_manifest
from mopd.store.format.manifest import Manifest
from mopd.store.locations.location import open_location
from mopd.store.summary import StoreSummary, summarise_store
from mopd.store.verify import verify_store
from mopd.train.checkpoint.verify import check_checkpoint


@click.command("verify-manifest")
@click.argument("store", type=STORE)
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    help="Also check that this config numbers the teachers as the store does.",
)
@click.option(
    "--checkpoint",
    type=click.Path(path_type=Path),
    help="Also check the teacher list recorded in this training checkpoint.",
)
@click.option("--full", is_flag=True, help="Re-hash every byte (default: sizes and shapes only).")
@click.option("--json", "as_json", is_flag=True, help="Print the problems as a JSON list.")
def verify_manifest_command(
    store: str, config_path: Path | None, checkpoint: Path | None, full: bool, as_json: bool
) -> None:
    """Prove that STORE is complete and unchanged, and agrees with a config and a checkpoint.

    Reports every problem, one per line (exit 1), or nothing (exit 0). Never writes to STORE.
    """
    config = load_config(config_path) if config_path is not None else None
    options = config.store.options if config else None
    manifest = _manifest(store, options)
    recorded = {t.checkpoint for t in manifest.teachers} if manifest is not None else set()
    problems, warnings = verify_store(
        store,
        options=options,
        teachers=teachers_as_found(config, recorded) if config else None,
        routing=config.routing.model_dump(mode="json") if config else None,
        encoding=config.store.encoding if config else None,
        full=full,
    )
    if config is not None and manifest is not None and manifest.tokenizer.fingerprint:
        # a store with teachers of other tokenizers only: the check loads tokenizers (transformers)
        from mopd.train.store_check import with_tokenizers

        problems = with_tokenizers(problems, config, manifest)
    if checkpoint is not None and manifest is not None:
        problems += check_checkpoint(checkpoint, manifest)
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)
    if as_json:
        click.echo(json.dumps(problems, indent=2))
    elif problems:
        for problem in problems:
            click.echo(problem)
    else:
        mode = "every byte hashed" if full else "sizes and shapes; --full hashes every byte"
        click.echo(f"ok: {store} is complete and consistent ({mode})")
    sys.exit(1 if problems else 0)


def _manifest(store: str, options: Mapping[str, str] | None) -> Manifest | None:
    """The store's manifest, read once for the checks beside the store's own; None where it cannot be
    read (that problem is the store's, which `verify_store` reports)."""
    try:
        return read_manifest(open_location(store, options))
    except MopdError:
        return None


def format_size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    raise AssertionError("unreachable")


@click.command("inspect")
@click.argument("store", type=STORE)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def inspect_command(store: str, as_json: bool) -> None:
    """Show the teachers, rows, tokens and bytes of STORE (in 80 columns; --json for scripts)."""
    summary = summarise_store(store)
    if as_json:
        click.echo(
            json.dumps(
                {
                    **dataclasses.asdict(summary),
                    "stored_bytes": summary.stored_bytes,
                    "compression_ratio": summary.compression_ratio,
                },
                indent=2,
                default=lambda record: record.model_dump(mode="json"),  # a teacher's calibration
            )
        )
        return
    # Fits 80 columns (a pipe, a default terminal): the table and each value's line do; a path longer
    # than that folds, a sentence wraps between words.
    console = Console()
    console.print(f"{summary.path}", markup=False, overflow="fold")
    console.print(f"format v{summary.format_version}, written by {summary.created_by}")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("#", justify="right")
    table.add_column("aliases", overflow="fold", max_width=20)
    for column in ("rows", "tokens", "on disk", "B/token", "as fp32 logits"):
        table.add_column(column, justify="right", no_wrap=True)
    for t in summary.teachers:
        table.add_row(
            str(t.index),
            ", ".join(t.aliases),
            f"{t.rows:,}",
            f"{t.tokens:,}",
            format_size(t.stored_bytes),
            f"{t.bytes_per_token:,.0f}",
            format_size(t.full_logit_bytes),
        )
    console.print(table)
    if summary.rows_by_teachers:
        names = {str(t.index): "+".join(t.aliases) for t in summary.teachers}
        sets = (
            f"{' & '.join(names[t] for t in key.split(','))} {rows:,}"
            for key, rows in summary.rows_by_teachers.items()
        )
        console.print(f"rows by teachers: {'; '.join(sets)}", markup=False, overflow="fold")
    for line in _teacher_notes(summary):
        console.print(line, markup=False, overflow="fold")
    console.print(
        f"the tokenizer has {summary.vocab_size:,} tokens, over which training distils (output rows past "
        "them are padding)"
    )
    console.print(f"{summary.rows:,} rows, {summary.tokens:,} tokens")
    console.print(f"hidden states {summary.hidden_dtype} ({summary.encoding}), codec {summary.codec}")
    console.print(
        f"{format_size(summary.stored_bytes)} on disk, compression ratio {summary.compression_ratio:.3f}"
    )


def _teacher_notes(summary: StoreSummary) -> list[str]:
    """The lines below the table: each teacher's checkpoint, its tokenizer's shares when it is another
    tokenizer than the store's, and an int8-rotated store's encoding cost."""
    lines = [
        line
        for t in summary.teachers
        for line in (
            f"{t.index}: {t.checkpoint}",
            f"{' ' * len(str(t.index))}  fingerprint {t.fingerprint[:12]}, hidden {t.hidden_size}, output "
            f"rows {t.vocab_size:,}",
        )
    ]
    for t in summary.teachers:
        if t.tokenizer is not None and t.aligned_share is not None and t.signal_share is not None:
            lines.append(
                f"{t.index}: another tokenizer ({t.tokenizer}): {t.aligned_share:.1%} of its trained "
                f"positions aligned with one of its own, {t.signal_share:.1%} aligned or inside a span"
            )
    for t in summary.teachers:
        if t.calibration is not None:
            c = t.calibration
            lines.append(
                f"{t.index}: int8-rotated costs KL {c.kl_mean:.2e} nats a token on average (p99 "
                f"{c.kl_p99:.2e}, max {c.kl_max:.2e}; top-1 agreement {c.top1_agreement:.1%}), measured on "
                f"its first {c.measured_tokens:,} tokens against the exact states"
            )
    return lines

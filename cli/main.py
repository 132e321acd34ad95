"""The `mopd` click group and the mapping of errors to exit codes (DESIGN §8).

Exit codes: 0 ok; 1 a problem found or a run failed for a stated reason (one clear message, no
traceback unless --debug); 2 usage error (click's own).
"""

from __future__ import annotations

import sys
from typing import Any

import click

from mopd.base.errors import MopdError
from mopd.base.version import __version__
from mopd.cli.precompute_command import precompute_command
from mopd.cli.quickstart import quickstart_command
from mopd.cli.rollout_commands import rollout_command, rounds_command
from mopd.cli.store_commands import inspect_command, verify_manifest_command
from mopd.cli.train_command import export_hf_command, train_command


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MopdError as err:
            if ctx.params.get("debug"):
                raise
            click.echo(f"error: {err}", err=True)
            sys.exit(1)
        except OSError as err:  # a full disk, an I/O error, a permission: one line naming the file
            if ctx.params.get("debug"):
                raise
            click.echo(f"error: {describe_os_error(err)}", err=True)
            sys.exit(1)


def describe_os_error(err: OSError) -> str:
    """`<operation> failed: <reason>: <path>` (the commit path names its operation; see store/faults)."""
    reason = err.strerror or str(err)
    return f"{reason}: {err.filename}" if err.filename else reason


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mopd")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
def cli(debug: bool) -> None:
    """mopd: distil one student LLM from several teachers through stored teacher hidden states."""


cli.add_command(precompute_command)
cli.add_command(verify_manifest_command)
cli.add_command(inspect_command)
cli.add_command(train_command)
cli.add_command(export_hf_command)
cli.add_command(rollout_command)
cli.add_command(rounds_command)
cli.add_command(quickstart_command)


def main() -> None:
    cli(prog_name="mopd")

"""The `mopd` click group and the mapping of errors to exit codes (DESIGN §8).

Exit codes: 0 ok; 1 a problem found or a run failed for a stated reason (one clear message, no
traceback unless --debug); 2 usage error (click's own); 130 interrupted (Ctrl-C), with a line on how
to carry on.
"""

from __future__ import annotations

import errno
import shutil
import sys
from pathlib import Path
from typing import Any

import click

from mopd.base.errors import MopdError
from mopd.base.version import __version__
from mopd.cli.precompute_command import precompute_command
from mopd.cli.quickstart import quickstart_command
from mopd.cli.rollout_commands import rollout_command, rounds_command
from mopd.cli.store_commands import inspect_command, verify_manifest_command
from mopd.cli.train_command import export_hf_command, train_command

# What a rerun of an interrupted command does (`mopd train` says which checkpoint it resumes from).
CARRY_ON = {
    "precompute": "finished tasks are kept; run the same command again to compute the rest",
    "rollout": "finished parts are kept; run the same command again to sample the rest",
    "rounds": "finished stages are kept; run the same command again to go on from the first unfinished one",
    "quickstart": "run it again: the models, data and a finished store are reused",
}


class _Group(click.Group):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """`--debug` anywhere on the line, after the command and its arguments as well as before."""
        if "--debug" in args:
            args = ["--debug", *(arg for arg in args if arg != "--debug")]
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            how = CARRY_ON.get(ctx.invoked_subcommand or "")
            click.echo("\ninterrupted" + (f": {how}" if how else ""), err=True)
            sys.exit(130)
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
    """`<operation> failed: <reason>: <path>` (the commit path names its operation; see base/faults),
    and for a full disk the space left where the file was going."""
    reason = err.strerror or str(err)
    if not err.filename:
        return reason
    line = f"{reason}: {err.filename}"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        folder = Path(err.filename)
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        line += f" ({shutil.disk_usage(folder).free / 2**20:,.1f} MiB free on its filesystem)"
    return line


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

from __future__ import annotations

import json

from click.testing import CliRunner

from mopd.cli.main import cli
from tests.store.synthetic import StoreSpec


def test_inspect_lists_teachers_and_sizes_in_100_columns(small_store: StoreSpec) -> None:
    result = CliRunner().invoke(cli, ["inspect", small_store.root], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    for alias in ("math, reasoning", "code", "chat"):
        assert alias in out
    assert f"{len(small_store.lengths)} rows, {sum(small_store.lengths)} tokens" in out
    assert "compression ratio" in out
    assert max(map(len, out.splitlines())) <= 100 and "…" not in out, out  # wrapped, never cut
    summary = json.loads(CliRunner().invoke(cli, ["inspect", small_store.root, "--json"]).stdout)
    assert summary["rows"] == len(small_store.lengths) and summary["tokens"] == sum(small_store.lengths)
    assert sorted(a for t in summary["teachers"] for a in t["aliases"]) == [
        "chat",
        "code",
        "math",
        "reasoning",
    ]
    assert summary["stored_bytes"] == sum(t["stored_bytes"] for t in summary["teachers"]) > 0


def test_inspect_incomplete_store_is_one_line_exit_1(small_store: StoreSpec) -> None:
    from pathlib import Path

    (Path(small_store.root) / "manifest.json").unlink()
    result = CliRunner().invoke(cli, ["inspect", small_store.root])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and "tasks are done" in result.stderr
    assert "Traceback" not in result.output


def test_usage_error_is_exit_2() -> None:
    assert CliRunner().invoke(cli, ["inspect"]).exit_code == 2
    assert CliRunner().invoke(cli, ["no-such-command"]).exit_code == 2


def test_version() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and result.stdout.startswith("mopd, version ")


def test_debug_shows_the_traceback_wherever_it_is_on_the_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    missing = str(tmp_path / "missing")
    for line in (
        ["--debug", "inspect", missing],
        ["inspect", missing, "--debug"],
        ["inspect", "--debug", missing],
    ):
        result = CliRunner().invoke(cli, line)
        assert result.exit_code == 1
        assert result.exception is not None and "does not exist" in str(result.exception), line
    plain = CliRunner().invoke(cli, ["inspect", missing])
    assert not isinstance(plain.exception, ValueError) and plain.stderr.startswith("error: ")

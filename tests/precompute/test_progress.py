"""Precompute's progress reaches a log file: plain lines where no terminal shows a live bar."""

from __future__ import annotations

import pytest

from mopd.precompute import progress
from mopd.precompute.progress import TokenProgress


def test_progress_prints_plain_lines_when_stderr_is_not_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    """The counts are the job's, over every teacher: each line names the teacher that runs now apart from
    them, never as if the job's rows were that teacher's."""
    with TokenProgress(total_rows=10, total_tokens=1000) as bar:
        bar.describe("math (1/2 teachers)")
        bar.advance(rows=4, tokens=400)
        bar.describe("code (2/2 teachers)")
        bar.advance(rows=6, tokens=600)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("precompute, ")]
    assert lines[0].startswith("precompute, math (1/2 teachers); job: 4/10 rows, 400/1,000 tokens, ")
    assert lines[1].startswith("precompute, code (2/2 teachers); job: 10/10 rows, 1,000/1,000 tokens, ")
    assert lines[1].endswith("0.0 min left")


def test_a_disabled_progress_prints_nothing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    with TokenProgress(total_rows=10, total_tokens=1000, enabled=False) as bar:
        bar.advance(rows=10, tokens=1000)
    assert capsys.readouterr().err == ""

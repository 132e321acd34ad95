"""bench/on_policy.py at toy size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each runs the benchmark's script end to end: a minute or so


def test_the_on_policy_bench_runs_at_toy_size(tmp_path: Path) -> None:
    """bench/on_policy.py end to end on the quickstart's models: one round of one step, one prompt per
    agent; both arms reach the table and report their trained tokens."""
    out = tmp_path / "on_policy.json"
    toy = ["--rounds", "1", "--steps", "1", "--prompts-per-agent", "1", "--heldout-per-agent", "1"]
    toy += ["--rows-per-agent", "3", "--max-new-tokens", "8", "--work", str(tmp_path / "work")]
    command = [sys.executable, "bench/on_policy.py", *toy, "--out", str(out)]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=900)
    payload = json.loads(out.read_text())
    assert [row["arm"] for row in payload["rows"]] == [
        "start",
        "on-policy, 1 rounds",
        "off-policy, fixed data",
    ]
    assert all(row["trained_tokens"] > 0 for row in payload["rows"][1:])
    assert [r["round"] for r in payload["on_policy_by_round"]] == [0, 1]

"""The suite's process check (tests/processes.py) fails a session that leaves a process running, and
names it with the test that started it; a session whose processes end passes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

LEAKS = """
import subprocess, sys

def test_leaves_a_child() -> None:
    # Detached and never waited for: it outlives this test and, unless the check ends the run, pytest.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
"""
ENDS = """
import subprocess, sys

def test_waits_for_its_child() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


def run_session(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    """pytest with the plugin alone (not this suite's conftest or options) on one test file, under two
    xdist workers as the suite runs."""
    (tmp_path / "test_case.py").write_text(source)
    command = [sys.executable, "-m", "pytest", "-q", "-c", os.devnull, "--rootdir", str(tmp_path)]
    command += ["-p", "tests.processes", "-p", "no:cacheprovider", "-n", "2", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # a pytest session of its own that waits out its survivor
def test_a_leaked_process_fails_the_session_and_is_named(tmp_path: Path) -> None:
    done = run_session(tmp_path, LEAKS)
    assert done.returncode == 1, done.stdout
    assert "1 process(es) started by the test session outlived it (now ended)" in done.stdout, done.stdout
    # Listed in the error and, where CI is set in the environment (pytest then does not trim its short
    # summary), once more in the summary: one process either way.
    (pid,) = set(
        re.findall(
            r"pid (\d+) \(started by test_case.py::test_leaves_a_child \(call\)\): \S+ -c import time",
            done.stdout,
        )
    )
    assert gone(int(pid))  # listed, then ended


def gone(pid: int) -> bool:
    """The process has ended (its pid is free, or it is a zombie awaiting its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def test_a_session_whose_processes_end_passes(tmp_path: Path) -> None:
    done = run_session(tmp_path, ENDS)
    assert done.returncode == 0, done.stdout
    assert "1 passed" in done.stdout

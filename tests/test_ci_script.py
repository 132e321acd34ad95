"""`.ci/run` runs the README's test command and fails when a test fails or when no test runs."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_commands() -> None:
    install, test = readme_commands()[:2]
    script = (REPO / ".ci" / "run").read_text()
    assert install.endswith("&& mopd quickstart")
    assert "\n    " + install + "\n" in script  # verbatim, inside the install branch
    after = script.split(install + "\n", 1)[1].splitlines()
    assert any(line.strip().startswith("[[ $? == 0 ]] || {") for line in after[:3])  # a failed step stops CI
    assert script.rstrip().splitlines()[-1] == test == "python -m pytest -q"
    assert "set -euo pipefail" in script


def run_ci_with(tests_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MOPD_CI_REUSE_ENV": "1", "PYTEST_ADDOPTS": f"{tests_dir} -p no:cacheprovider"}
    return subprocess.run(["bash", ".ci/run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_ci_fails_on_a_failing_test_and_on_no_tests(tmp_path: Path) -> None:
    failing = tmp_path / "failing"
    failing.mkdir()
    (failing / "test_fails.py").write_text("def test_fails():\n    assert 1 == 2\n")
    result = run_ci_with(failing)
    assert result.returncode != 0
    assert "1 failed" in result.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_ci_with(empty)
    assert result.returncode == 5  # pytest's "no tests ran", passed through
    assert "no tests ran" in result.stdout

"""bench/lossy.py at toy size, and its summary over seeds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the benchmark's script end to end
def test_the_lossy_bench_runs_at_toy_size(tmp_path: Path) -> None:
    """bench/lossy.py on 4 quickstart rows per agent and 2 training steps: every tier reports its bytes,
    speeds and KL from the fp32 store, the decode costs, and the students' held-out divergences."""
    out = tmp_path / "lossy.json"
    toy = ["--rows-per-agent", "4", "--steps", "2", "--eval-rows", "4", "--seeds", "1"]
    toy += ["--workdir", str(tmp_path / "work")]
    command = [sys.executable, "bench/lossy.py", *toy, "--out", str(out)]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=900)
    payload = json.loads(out.read_text())
    tiers = payload["tiers"]
    assert list(tiers) == ["exact_fp32", "exact_bf16", "int8_bf16", "int8_fp32"]
    assert tiers["exact_bf16"]["bytes_per_token_ratio"] == 1.0
    assert tiers["int8_bf16"]["bytes_per_token"] == tiers["int8_fp32"]["bytes_per_token"]
    for tier in ("exact_bf16", "int8_bf16", "int8_fp32"):
        measured = tiers[tier]["vs_exact_fp32"]
        assert 0 <= measured["kl_mean"] <= measured["kl_p99"] <= measured["kl_max"]
        assert ("kl_mean_error_model" in measured) == tier.startswith("int8")
    assert all(payload["decode"][f"{k}_s_per_token"] > 0 for k in ("encode", "loader", "folded"))
    (arms,) = payload["distillation"]["by_seed"].values()
    assert list(arms) == ["exact_bf16", "int8_bf16", "exact_fp32"]
    assert all(arm["steps"] == 2 for arm in arms.values())
    assert arms["exact_bf16"]["relative_difference_by_teacher"] == {"0": 0.0, "1": 0.0}
    summary = payload["distillation"]["relative_difference_by_teacher"]["int8_bf16"]["1"]
    assert summary == {
        "seeds": 1,
        "mean": arms["int8_bf16"]["relative_difference_by_teacher"]["1"],
        "standard_error": None,
    }


def test_the_lossy_bench_summarises_each_arm_over_the_seeds() -> None:
    """Each arm's held-out divergence relative to the bf16 arm of its seed; the mean over the seeds that
    trained the arm and its standard error (sample standard deviation / sqrt(n))."""
    from bench.lossy import relative_differences

    def arm(t0: float, t1: float) -> dict[str, Any]:
        return {"heldout_divergence_by_teacher": {"0": t0, "1": t1}}

    by_seed = {
        "0": {"exact_bf16": arm(2.0, 0.5), "int8_bf16": arm(2.2, 0.5), "exact_fp32": arm(2.0, 0.25)},
        "1": {"exact_bf16": arm(4.0, 1.0), "int8_bf16": arm(3.6, 1.5)},
    }
    summary = relative_differences(by_seed)
    assert by_seed["1"]["int8_bf16"]["relative_difference_by_teacher"] == pytest.approx({"0": -0.1, "1": 0.5})
    # Differences +0.1 and −0.1 on teacher 0, 0 and +0.5 on teacher 1; float64 sums of a few terms
    # (approx's 1e-6 is far above their rounding).
    assert summary["int8_bf16"]["0"] == pytest.approx({"seeds": 2, "mean": 0.0, "standard_error": 0.1})
    assert summary["int8_bf16"]["1"] == pytest.approx({"seeds": 2, "mean": 0.25, "standard_error": 0.25})
    assert summary["exact_fp32"]["1"] == {"seeds": 1, "mean": -0.5, "standard_error": None}

"""bench/gpu.py at toy sizes on the CPU: every section runs and reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tolerance import BF16_U, bf16_trajectory_rtol

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("gemm", "chain", "kernel", "step", "sharded", "precompute")
pytestmark = pytest.mark.slow  # each runs the benchmark's script end to end: a minute or so


def test_the_gpu_bench_runs_every_section_at_toy_sizes(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    command = [sys.executable, "bench/gpu.py", "--small", "--device", "cpu", "--out", str(out)]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=600)
    payload = json.loads(out.read_text())
    assert {name: payload[name].get("failed") for name in SECTIONS} == dict.fromkeys(SECTIONS)
    precompute = payload["precompute"]  # on the CPU the "device" store is the CPU's bf16 store again
    assert precompute["within_bf16_error"] and precompute["rows"] == 6 and precompute["tokens_per_s"] > 0
    assert precompute["device_bf16_vs_fp32"] == precompute["cpu_bf16_vs_fp32"]
    # A 2-block forward in bf16 (half of bf16_trajectory_rtol's forward and backward), and its states
    # rounded to bf16 once more when stored.
    bound = bf16_trajectory_rtol(1, layers=2) / 2 + BF16_U
    assert 0 < precompute["cpu_bf16_vs_fp32"]["state_rel_error"] < bound

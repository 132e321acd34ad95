"""The GPU benchmark runs on a lent GPU only, minutes at a time: a section that no longer matches mopd's
API must fail here, on the CPU at toy sizes, not there (a check of the script, not a measurement)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("gemm", "chain", "kernel", "step")


def test_the_gpu_bench_runs_every_section_at_toy_sizes(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    command = [sys.executable, "bench/gpu.py", "--small", "--device", "cpu", "--out", str(out)]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=600)
    payload = json.loads(out.read_text())
    assert {name: payload[name].get("failed") for name in SECTIONS} == dict.fromkeys(SECTIONS)

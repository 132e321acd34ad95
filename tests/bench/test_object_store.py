"""bench/object_store.py at toy size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each runs the benchmark's script end to end: a minute or so


def test_the_object_store_bench_runs_at_toy_size(tmp_path: Path) -> None:
    """bench/object_store.py on a store of 200 rows, on disk and in a bucket at 5 ms a request: every
    location reports every figure, and the requests went through the proxy that delays them."""
    out = tmp_path / "object_store.json"
    toy = ["--rows", "200", "--tokens", "20", "--delays-ms", "5", "--read-rows", "50"]
    command = [sys.executable, "bench/object_store.py", *toy, "--out", str(out)]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=900)
    (size,) = json.loads(out.read_text())["sizes"]
    assert [k for k in size if k != "rows"] == ["disk", "s3_5ms"]
    assert size["s3_5ms"].keys() >= size["disk"].keys()
    assert size["s3_5ms"]["requests"] > 0 and size["s3_5ms"]["store_mb"] == size["disk"]["store_mb"]
    assert all(0 <= size[place]["train_data_wait"] <= 1 for place in ("disk", "s3_5ms"))

"""Resident memory of the running process, for benchmarks that measure one step's peak."""

from __future__ import annotations

from pathlib import Path


def rss_bytes(field: str) -> int:
    """`VmRSS` (now) or `VmHWM` (high-water mark) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    """Resets the resident high-water mark (`VmHWM`) to the current resident size."""
    Path("/proc/self/clear_refs").write_text("5\n")

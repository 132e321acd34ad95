"""What a person reads of a run: step lines with an ETA and teachers by name, evaluations at 4
significant digits, the start line, the CE term, the plot's legend (issue 32)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from mopd.train.report.metrics import (
    METRICS_FILE,
    Eta,
    Lap,
    StepClock,
    format_duration,
    metrics_figure,
    read_metrics,
    read_teacher_names,
)
from mopd.train.trainer import run_training
from tests.train.world import World, world_config


def test_eta_is_the_median_of_recent_step_times_times_the_steps_left() -> None:
    eta = Eta(window=3)
    assert eta.remaining(5) is None
    for seconds, left, expected in [
        (10, 5, 50),
        (1, 5, 27.5),
        (2, 5, 10),
        (3, 2, 4),
        (100, 2, 6),
        (0.5, 0, 0),
    ]:
        eta.add(seconds)
        assert eta.remaining(left) == expected, (seconds, left)
    # [10] → 10; [10, 1] → 5.5; [10, 1, 2] → 2; the window drops 10: [1, 2, 3] → 2; [2, 3, 100] → 3.
    assert [format_duration(s) for s in (0.4, 42, 185, 7620, 273_600)] == [
        "0s",
        "42s",
        "3m05s",
        "2h07m",
        "3d04h",
    ]


def significant_digits(number: str) -> int:
    """Of a number as printed: `0.003612` and `3.612e-05` have 4."""
    return len(number.split("e")[0].replace(".", "").lstrip("0"))


def fake_laps(seconds: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    """Step times `seconds`, one per lap, whatever the steps really took."""
    given = iter(seconds)

    def lap(self: StepClock, tokens: int) -> Lap:
        wall = next(given)
        return Lap(tokens_per_s=tokens / wall, data_wait=0.0, step_seconds=wall)

    monkeypatch.setattr(StepClock, "lap", lap)


def run_lines(config: Any) -> list[str]:
    lines: list[str] = []
    run_training(config, log=lines.append)
    return lines


def test_step_lines_name_teachers_and_carry_the_eta(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faked step times 30, 10, 20, 40 s over 4 steps: ETAs 30×3, median(30, 10)×2, median(30, 10, 20)×1
    and 0; teachers by alias; eval lines at 4 significant digits; the CE term when it is on."""
    fake_laps([30, 10, 20, 40], monkeypatch)
    config = world_config(
        world, tmp_path, steps=4, eval={"rows": 4, "every": 2}, divergence={"ce_weight": 0.5}
    )
    lines = run_lines(config)
    steps = [line for line in lines if line.startswith("step ")]
    assert [re.search(r" eta (\S+)$", line).group(1) for line in steps] == ["1m30s", "40s", "20s", "0s"]
    names = read_teacher_names(tmp_path / "run" / METRICS_FILE)
    assert sorted(names.values()) == ["code", "math"]
    for line in steps:
        assert re.search(r"\[code=\S+ math=\S+\]|\[math=\S+ code=\S+\]", line), line
        assert re.search(r" ce \d", line), line
    evals = [line for line in lines if line.startswith("eval ")]
    assert len(evals) == 3
    for line in evals:
        numbers = re.findall(r"\d[\d.]*(?:e[+-]\d+)?", line.split(":", 1)[1])
        assert numbers and max(map(significant_digits, numbers)) <= 4, line
    assert not [line for line in lines if re.search(r"\bt\d=|'\d':|teacher \d", line)]
    (plan,) = [line for line in lines if line.startswith("training steps 1..4:")]
    assert re.search(r"4 steps ≈ [\d,]+ tokens ≈ [\d.]+ epochs of \d+ rows \(\d+ steps an epoch\)", plan), (
        plan
    )
    records = [r for r in read_metrics(tmp_path / "run" / METRICS_FILE) if "split" not in r]
    assert len(records) == 4 and all(r["ce"] > 0 for r in records)  # hard-label CE per trained token
    legend = [
        t.get_text()
        for ax in metrics_figure(tmp_path / "run" / METRICS_FILE).axes
        for t in ax.get_legend().get_texts()
    ]
    assert sorted(legend) == ["CE term", "code", "code (eval)", "loss", "math", "math (eval)"]


def test_no_ce_term_without_ce_weight(world: World, tmp_path: Path) -> None:
    lines = run_lines(world_config(world, tmp_path, steps=1))
    assert not [line for line in lines if " ce " in line]
    assert "ce" not in read_metrics(tmp_path / "run" / METRICS_FILE)[0]

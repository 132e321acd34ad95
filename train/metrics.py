"""`OUTPUT/metrics.jsonl` (one JSON object per optimiser step, DESIGN §7), the step line and the plot."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, TypedDict

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"


class DivergenceStats(TypedDict):
    """The per-token divergence of a step's (or an evaluation's) trained tokens, over all replicas."""

    divergence: float  # mean over the tokens
    divergence_by_teacher: dict[str, float]  # mean over each teacher's tokens, by teacher index
    divergence_min: float
    divergence_max: float
    trained_tokens: int


class EvalRecord(DivergenceStats):
    """One evaluation of the held-out rows: a line of metrics.jsonl."""

    split: Literal["eval"]
    step: int


class StepOutcome(DivergenceStats):
    """What one optimiser step did."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int  # all tokens of the step, over the replicas
    memory_gib: float


class Lap(TypedDict):
    """The wall time from the end of one step to the end of the next (`StepClock.lap`)."""

    tokens_per_s: float
    data_wait: float  # fraction of the lap spent waiting for data
    step_seconds: float


class TrainRecord(StepOutcome, Lap):
    """One trained step: a line of metrics.jsonl."""


Record = TrainRecord | EvalRecord


class MetricsLog:
    """Appends one JSON line per record, flushed at once (a crash loses at most the line being written).

    On resume, lines of steps after the resumed checkpoint (trained, then lost with the crash) are
    dropped, so every step appears once.
    """

    def __init__(self, output: Path, *, resume_step: int | None) -> None:
        self.path = output / METRICS_FILE
        output.mkdir(parents=True, exist_ok=True)
        kept = read_metrics(self.path) if resume_step is not None and self.path.exists() else []
        kept = [r for r in kept if r["step"] <= (resume_step or 0)]
        temp = self.path.with_name(self.path.name + ".rewrite")
        temp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        os.replace(temp, self.path)
        self._file = self.path.open("a")

    def write(self, record: Record) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file; a torn last line (a crash mid-write) is ignored."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


class StepClock:
    """Wall-clock throughput between consecutive steps, and the share of it spent waiting for data.

    A lap runs from the end of one step to the end of the next, so it holds everything the run did in
    between (the data wait, the step, a checkpoint save or an evaluation): the rate a user's run makes.
    The first lap starts when the clock is made.
    """

    def __init__(self) -> None:
        self._lap_start = time.perf_counter()
        self._waited = 0.0

    @contextmanager
    def waiting(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._waited += time.perf_counter() - start

    def lap(self, tokens: int) -> Lap:
        """`tokens_per_s` (of wall time) and `data_wait` (fraction of it) since the last lap."""
        now = time.perf_counter()
        wall = max(now - self._lap_start, 1e-9)
        lap = Lap(tokens_per_s=tokens / wall, data_wait=self._waited / wall, step_seconds=wall)
        self._lap_start, self._waited = now, 0.0
        return lap


def step_line(record: TrainRecord, total_steps: int) -> str:
    """The one-line summary printed per step."""
    by_teacher = " ".join(f"t{t}={v:.4g}" for t, v in sorted(record["divergence_by_teacher"].items()))
    return (
        f"step {record['step']}/{total_steps} loss {record['loss']:.5g} div {record['divergence']:.5g} "
        f"[{by_teacher}] min {record['divergence_min']:.3g} max {record['divergence_max']:.3g} "
        f"gnorm {record['grad_norm']:.3g} lr {record['lr']:.3g} {record['tokens_per_s']:,.0f} tok/s "
        f"(data wait {record['data_wait']:.0%}) mem {record['memory_gib']:.2f} GiB"
    )


def eval_line(record: EvalRecord) -> str:
    """The line printed per evaluation."""
    return (
        f"eval step {record['step']}: divergence {record['divergence']:.5g} {record['divergence_by_teacher']}"
    )


def plot_metrics(metrics: Path, out: Path) -> Path:
    """Draws loss and per-teacher divergence (train, and eval where present) against step into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics)
    train = [r for r in records if r.get("split", "train") == "train"]
    evals = [r for r in records if r.get("split") == "eval"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([r["step"] for r in train], [r["loss"] for r in train], label="loss")
    left.set(xlabel="step", ylabel="loss", title="training loss")
    teachers = sorted({t for r in records for t in r["divergence_by_teacher"]}, key=int)
    for t in teachers:
        for rows, style, label in ((train, "-", f"teacher {t}"), (evals, "o--", f"teacher {t} (eval)")):
            points = [(r["step"], r["divergence_by_teacher"].get(t)) for r in rows]
            points = [(step, value) for step, value in points if value is not None]
            if points:
                steps, values = zip(*points, strict=True)
                right.plot(steps, values, style, label=label, color=f"C{int(t) % 10}")
    positive = all(v > 0 for r in records for v in r["divergence_by_teacher"].values())
    right.set(
        xlabel="step",
        ylabel="divergence per token",
        title="divergence by teacher",
        yscale="log" if positive else "linear",  # fp32 KL near 0 can round to tiny negatives
    )
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

"""`OUTPUT/metrics.jsonl` (one JSON object per optimiser step, DESIGN §7), the step line and the plot.

Records key teachers by index, as the store numbers them; what a person reads (the console, the plot)
names them by their aliases, `chat+math` for a teacher under two. metrics.jsonl keeps full precision and
opens with the index → name map (a line without a step, which `read_metrics` leaves out).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

from mopd.store.format.manifest import TeacherInfo
from mopd.store.format.teachers import TeacherSlot

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"

TeacherNames = dict[str, str]  # teacher index, as records key it → the name a person reads


def teacher_names(teachers: Iterable[TeacherInfo | TeacherSlot]) -> TeacherNames:
    """Each teacher's aliases joined by `+` (sorted, as the store and the config number them), by
    teacher index."""
    return {str(t.index): "+".join(t.aliases) for t in teachers}


def set_key(teachers: Iterable[int]) -> str:
    """How records key the tokens whose target mixes several teachers: their indices joined by `,`."""
    return ",".join(str(t) for t in teachers)


def name_of(key: str, names: TeacherNames) -> str:
    """A record key's name: a teacher's, or a set's (its teachers' names joined by ` & `)."""
    return " & ".join(names.get(t, t) for t in key.split(","))


def _order(key: str) -> tuple[int, ...]:
    """Teachers first, by index, then the sets (`set_key`)."""
    parts = tuple(int(t) for t in key.split(","))
    return (len(parts), *parts)


def by_name(values: dict[str, float], names: TeacherNames) -> dict[str, float]:
    """`values` keyed by teacher (or teacher set) name instead of index (an index without a name keeps
    its number)."""
    return {name_of(t, names): v for t, v in sorted(values.items(), key=lambda item: _order(item[0]))}


class DivergenceStats(TypedDict):
    """The per-token divergence of a step's (or an evaluation's) trained tokens, over all replicas."""

    divergence: float  # mean over the tokens
    divergence_by_teacher: dict[str, float]  # mean over each teacher's tokens, by teacher index
    divergence_min: float
    divergence_max: float
    trained_tokens: int  # those with a divergence
    # Teachers of other tokenizers: the share of their trained tokens with an aligned teacher position.
    aligned_share_by_teacher: NotRequired[dict[str, float]]
    # train.ensemble.method min_ce / confidence: each teacher's share of the tokens it scores (DESIGN §14)
    selection_share_by_teacher: NotRequired[dict[str, float]]


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
    # The cross-entropy term (per trained token, before train.divergence.ce_weight), when it is on.
    ce: NotRequired[float]
    # The span log-likelihood match (per trained token, before train.cross_tokenizer.span_weight), when
    # the step had trained spans of teachers of other tokenizers.
    span: NotRequired[float]


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

    The file opens with the teacher names. On resume, lines of steps after the resumed checkpoint
    (trained, then lost with the crash) are dropped, so every step appears once.
    """

    def __init__(self, output: Path, *, resume_step: int | None, names: TeacherNames) -> None:
        self.path = output / METRICS_FILE
        output.mkdir(parents=True, exist_ok=True)
        kept = read_metrics(self.path) if resume_step is not None and self.path.exists() else []
        kept = [r for r in kept if r["step"] <= (resume_step or 0)]
        lines = [{"teachers": names}, *kept]
        temp = self.path.with_name(self.path.name + ".rewrite")
        temp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in lines))
        os.replace(temp, self.path)
        self._file = self.path.open("a")

    def write(self, record: Record) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except ValueError:  # a torn last line (a crash mid-write)
            continue


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step and evaluation records of a metrics file; a torn last line is ignored."""
    return [record for record in _lines(path) if "step" in record]


def read_teacher_names(path: Path) -> TeacherNames:
    """The teacher names a metrics file opens with (none in a file of an earlier mopd)."""
    return next((record["teachers"] for record in _lines(path) if "teachers" in record), {})


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


class Eta:
    """The time a run has left: the median of its recent step times (robust to the slow first step
    and to steps that also save a checkpoint or evaluate), times the steps left."""

    def __init__(self, window: int = 20) -> None:
        self._recent: deque[float] = deque(maxlen=window)

    def add(self, seconds: float) -> None:
        self._recent.append(seconds)

    def remaining(self, steps_left: int) -> float | None:
        """Seconds left for `steps_left` more steps; None before the first step."""
        return statistics.median(self._recent) * steps_left if self._recent else None


def format_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`, `3d04h`: two units at most, the larger first."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _by_teacher(values: dict[str, float], names: TeacherNames) -> str:
    return " ".join(f"{name}={v:.4g}" for name, v in by_name(values, names).items())


def step_line(record: TrainRecord, total_steps: int, names: TeacherNames, eta: float | None = None) -> str:
    """The one-line summary printed per step: 4 significant digits, teachers by name."""
    ce = f" ce {record['ce']:.4g}" if "ce" in record else ""
    ce += f" span {record['span']:.4g}" if "span" in record else ""
    left = f" eta {format_duration(eta)}" if eta is not None else ""
    return (
        f"step {record['step']}/{total_steps} loss {record['loss']:.4g}{ce} div {record['divergence']:.4g} "
        f"[{_by_teacher(record['divergence_by_teacher'], names)}] min {record['divergence_min']:.3g} "
        f"max {record['divergence_max']:.3g}{_aligned(record, names)} gnorm {record['grad_norm']:.3g} "
        f"lr {record['lr']:.3g} "
        f"{record['tokens_per_s']:,.0f} tok/s (data wait {record['data_wait']:.0%}) "
        f"mem {record['memory_gib']:.2f} GiB{left}"
    )


def eval_line(record: EvalRecord, names: TeacherNames) -> str:
    """The line printed per evaluation: 4 significant digits, teachers by name."""
    return (
        f"eval step {record['step']}: divergence {record['divergence']:.4g} "
        f"[{_by_teacher(record['divergence_by_teacher'], names)}]{_aligned(record, names)}"
    )


def _aligned(record: DivergenceStats, names: TeacherNames) -> str:
    """' aligned [name=share …]' for teachers of other tokenizers, ' chosen [name=share …]' for the
    teachers of an ensemble that chooses; '' without either."""
    out = ""
    chosen = record.get("selection_share_by_teacher")
    for word, shares in (("aligned", record.get("aligned_share_by_teacher")), ("chosen", chosen)):
        if shares:
            out += f" {word} [" + " ".join(f"{n}={v:.1%}" for n, v in by_name(shares, names).items()) + "]"
    return out


def plot_metrics(metrics: Path, out: Path) -> Path:
    """Draws loss and per-teacher divergence (train, and eval where present) against step into a PNG."""
    import matplotlib.pyplot as plt

    fig = metrics_figure(metrics)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def metrics_figure(metrics: Path) -> Any:
    """The plot of `plot_metrics`, as a matplotlib figure: teachers by name in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics)
    names = read_teacher_names(metrics)
    train = [r for r in records if r.get("split", "train") == "train"]
    evals = [r for r in records if r.get("split") == "eval"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([r["step"] for r in train], [r["loss"] for r in train], label="loss")
    with_ce = [r for r in train if "ce" in r]
    if with_ce:
        left.plot([r["step"] for r in with_ce], [r["ce"] for r in with_ce], label="CE term")
    left.set(xlabel="step", ylabel="loss", title="training loss")
    teachers = sorted({t for r in records for t in r["divergence_by_teacher"]}, key=_order)
    for t in teachers:
        name = name_of(t, names) if t in names or "," in t else f"teacher {t}"
        for rows, style, label in ((train, "-", name), (evals, "o--", f"{name} (eval)")):
            points = [(r["step"], r["divergence_by_teacher"].get(t)) for r in rows]
            points = [(step, value) for step, value in points if value is not None]
            if points:
                steps, values = zip(*points, strict=True)
                right.plot(steps, values, style, label=label, color=f"C{teachers.index(t) % 10}")
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
    return fig

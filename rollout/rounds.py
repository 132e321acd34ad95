"""`mopd rounds`: on-policy distillation in rounds of sample, score, train.

Round r (1..count) samples the prompts with the student of round r − 1 (round 0's is `train.student`),
precomputes a store of the samples (mixed with `off_policy_fraction` of the fixed dataset), verifies it,
and trains `steps_per_round` steps starting from round r − 1's last checkpoint through `train.init_from`
(a new run: its data changed), then exports the student. After round 0's start and every round, the
round's student samples the held-out prompts and its divergence per teacher on those samples is logged
(`rounds.jsonl`) and plotted (`heldout.png`).

Every stage leaves a result that exists only when it is whole (a dataset renamed into place, a store
with its manifest, a checkpoint, an exported folder, a record), and each stage first looks for it: a
killed `mopd rounds` reruns from the first unfinished stage, and the stages that resume themselves
(a rollout's parts, precompute's tasks, training's checkpoints) carry on from where they were.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict

from mopd.base.errors import ConfigError, ManifestError
from mopd.base.fsio import write_replace, write_replace_with
from mopd.base.jsonio import read_json, validated
from mopd.config.mopd_config import MopdConfig
from mopd.config.rollout import RoundsConfig
from mopd.config.train import InitFromConfig, TrainConfig
from mopd.precompute.data import tokenize_dataset
from mopd.precompute.records import load_records
from mopd.precompute.runner import run_precompute
from mopd.precompute.teachers import load_tokenizer, tokenizer_checkpoint
from mopd.rollout.runner import run_rollout
from mopd.store.format.loading import read_manifest
from mopd.store.format.manifest import MANIFEST_FILE
from mopd.store.format.teachers import alias_to_index, assign_teacher_indices
from mopd.store.verify import verify_store
from mopd.train.checkpoint.export import export_hf
from mopd.train.checkpoint.state import latest_checkpoint, read_state
from mopd.train.evaluation import evaluate_student
from mopd.train.report.metrics import Eta, by_name, format_duration, teacher_names
from mopd.train.report.tracking import Trackers
from mopd.train.trainer import run_training

Log = Callable[[str], None]
SETTINGS_FILE = "rounds.json"
LOG_FILE = "rounds.jsonl"
PLOT_FILE = "heldout.png"
VERIFIED_FILE = "verified.json"
TRACKING_FILE = "tracking.json"  # the tracker runs the rounds report to, kept for a rerun


class RoundRecord(BaseModel):
    """A round's held-out evaluation: its `heldout/eval.json`, and a line of `rounds.jsonl`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    round: int
    student: str
    heldout_divergence: float
    heldout_by_teacher: dict[str, float]
    heldout_tokens: int
    steps: int
    sampling_temperature: float | None
    loss_temperature: float
    # Teachers of other tokenizers (DESIGN §13): the share of their held-out tokens with an aligned
    # position, by name (their divergence is over those); absent where there are none.
    heldout_aligned_share: dict[str, float] | None = None


def read_round_record(path: Path) -> RoundRecord:
    """A round's `eval.json`, refused in one line naming it when it is not a round record.

    Raises:
        ConfigError: it does not parse as one.
    """
    raw = read_json(path, what="round record", error=ConfigError)
    what = f"{path}: malformed round record (delete it to evaluate the round again)"
    return validated(RoundRecord, raw, what=what, error=ConfigError)


class Rounds:
    """The rounds of one config in its `rounds.workdir`."""

    def __init__(self, config: MopdConfig, log: Log) -> None:
        if config.rounds is None or config.rollout is None or config.train is None:
            raise ConfigError("mopd rounds needs the `rounds`, `rollout` and `train` sections of the config")
        self.config = config
        self.rounds: RoundsConfig = config.rounds
        self.train: TrainConfig = config.train
        self.workdir = Path(self.rounds.workdir)
        self.log = log
        self.names = teacher_names(assign_teacher_indices(config.teachers))
        self.trackers: Trackers | None = None  # opened by `track`

    def folder(self, r: int) -> Path:
        return self.workdir / f"round-{r:03d}"

    def student(self, r: int) -> str:
        """The transformers checkpoint of round r's student (round 0: train.student)."""
        return self.train.student if r == 0 else str(self.folder(r) / "student")

    def check_settings(self) -> None:
        """A workdir serves one config: any setting but rounds.count changed is refused."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        settings = self.config.model_dump(mode="json")
        settings["rounds"].pop("count")
        path = self.workdir / SETTINGS_FILE
        if not path.exists():
            write_replace(path, json.dumps(settings, indent=1, sort_keys=True).encode())
            return
        found = json.loads(path.read_text())
        changed = sorted(k for k in set(found) | set(settings) if found.get(k) != settings.get(k))
        if changed:
            raise ConfigError(
                f"rounds.workdir {self.workdir} holds rounds of another config (sections that differ: "
                f"{', '.join(changed)}); restore them, or choose another rounds.workdir (only rounds.count "
                "may change, to add rounds)"
            )

    def config_for(
        self, data: Path, store: Path, run: Path, *, init_from: Path | None, optimizer: bool
    ) -> MopdConfig:
        """The config of one stage: its dataset, store and run folder, started from `init_from`."""
        start = InitFromConfig(checkpoint=str(init_from), optimizer=optimizer) if init_from else None
        train = self.train.model_copy(
            update={"steps": self.rounds.steps_per_round, "output_dir": str(run), "init_from": start}
        )
        return self.config.model_copy(
            update={
                "data": self.config.data.model_copy(update={"path": str(data)}),
                "store": self.config.store.model_copy(update={"path": str(store)}),
                "train": train,
            }
        )

    # --- stages: each returns at once when its result exists ---

    def sample(self, r: int, out: Path, *, prompts: str, student: str) -> None:
        if out.exists():
            return
        run_rollout(
            self.config, student=student, output=out, prompts_path=prompts, round_index=r, log=self.log
        )

    def mix(self, r: int, samples: Path) -> Path:
        """The round's dataset: the samples, plus the fixed dataset's share when off_policy_fraction > 0."""
        fraction = self.rounds.off_policy_fraction
        if fraction == 0:
            return samples
        out = self.folder(r) / "data.parquet"
        if out.exists():
            return out
        on = pq.read_table(samples)
        count = round(on.num_rows * fraction / (1 - fraction))
        fixed = self.off_policy_rows()
        if count > fixed.num_rows:
            raise ConfigError(
                f"rounds.off_policy_fraction {fraction} needs {count} rows of data.path per round; it holds "
                f"{fixed.num_rows}: lower the fraction or add rows"
            )
        chosen = np.sort(
            np.random.default_rng([self.train.seed, r]).choice(fixed.num_rows, count, replace=False)
        )
        field = self.config.routing.field
        on_rows = on.select(["id", "input_ids", "loss_mask"]).append_column(
            field, on.column(field) if field in on.column_names else pa.array([""] * on.num_rows)
        )
        off = fixed.take(pa.array(chosen))
        off_rows = pa.table(
            {
                "id": pa.array([f"{key}/off" for key in off.column("source_key").to_pylist()]),
                "input_ids": off.column("input_ids"),
                "loss_mask": off.column("loss_mask"),
                field: off.column("agent"),
            }
        )
        mixed = pa.concat_tables(
            [
                on_rows.append_column("policy", pa.array(["on"] * on.num_rows)),
                off_rows.cast(on_rows.schema).append_column("policy", pa.array(["off"] * count)),
            ]
        )
        write_replace_with(out, lambda temp: pq.write_table(mixed, temp))
        self.log(f"round {r}: {on.num_rows} samples + {count} rows of {self.config.data.path}")
        return out

    def off_policy_rows(self) -> pa.Table:
        """The fixed dataset (data.path), tokenised and routed as precompute does."""
        return tokenize_dataset(
            load_records(self.config.data.path),
            data=self.config.data,
            routing=self.config.routing,
            agent_to_alias=self.config.agent_to_alias(),
            alias_index=alias_to_index(assign_teacher_indices(self.config.teachers)),
            tokenizer=load_tokenizer(tokenizer_checkpoint(self.config.teachers, self.config.tokenizer)),
        ).table

    def score(self, config: MopdConfig) -> None:
        """The store of the round's rows, precomputed (resumably) and verified once."""
        store = Path(config.store.path)
        marker = store.parent / (store.name + "." + VERIFIED_FILE)
        if marker.exists():
            return
        if not (store / MANIFEST_FILE).exists():
            run_precompute(config, log=self.log)
        problems, _warnings = verify_store(store, teachers=config.teachers)
        if problems:
            raise ManifestError(f"the store {store} does not verify:\n  " + "\n  ".join(problems))
        write_replace(marker, json.dumps({"manifest": read_manifest(store).hash()}).encode())

    def fit(self, config: MopdConfig) -> Path:
        """Trains the round (resuming its own checkpoints) and returns its run folder."""
        run = Path(config.train.output_dir if config.train else "")
        latest = latest_checkpoint(run)
        if latest is None or read_state(latest).step < self.rounds.steps_per_round:
            run_training(config, resume=None, log=self.log)
        return run

    def export(self, r: int, run: Path) -> None:
        if not Path(self.student(r)).exists():
            export_hf(run, Path(self.student(r)))

    def evaluate(self, r: int, *, run: Path | None) -> RoundRecord | None:
        """Round r's student on its own samples of the held-out prompts: divergence per teacher."""
        if self.rounds.heldout_prompts is None:
            return None
        folder = self.folder(r) / "heldout"
        record_path = folder / "eval.json"
        if record_path.exists():
            return read_round_record(record_path)
        folder.mkdir(parents=True, exist_ok=True)
        samples = folder / "samples.parquet"
        self.sample(r, samples, prompts=self.rounds.heldout_prompts, student=self.student(r))
        config = self.config_for(
            samples, folder / "store.zarr", folder / "eval", init_from=run, optimizer=False
        )
        self.score(config)
        evaluated = evaluate_student(config, store_path=folder / "store.zarr", log=self.log)
        if self.trackers is not None:
            self.trackers.log({**evaluated, "split": "rounds", "step": r})
        record = RoundRecord(
            round=r,
            student=self.student(r),
            heldout_divergence=evaluated["divergence"],
            heldout_by_teacher=by_name(evaluated["divergence_by_teacher"], self.names),
            heldout_tokens=evaluated["trained_tokens"],
            steps=r * self.rounds.steps_per_round,
            sampling_temperature=self.config.rollout.temperature if self.config.rollout else None,
            loss_temperature=self.train.divergence.temperature,
            heldout_aligned_share=(
                by_name(evaluated["aligned_share_by_teacher"], self.names)
                if "aligned_share_by_teacher" in evaluated
                else None
            ),
        )
        write_replace(record_path, json.dumps(record.model_dump(exclude_none=True), sort_keys=True).encode())
        shares = record.heldout_aligned_share or {}
        self.log(
            f"round {r}: held-out divergence {record.heldout_divergence:.4g} on its own samples ("
            + ", ".join(
                f"{a} {v:.4g}" + (f" aligned {shares[a]:.1%}" if a in shares else "")
                for a, v in record.heldout_by_teacher.items()
            )
            + ")"
        )
        return record

    def track(self) -> Trackers:
        """The trackers of `train.report_to` over the workdir (each round's training run has its own),
        appending to the runs of an earlier `mopd rounds` of this workdir."""
        path = self.workdir / TRACKING_FILE
        resumed = json.loads(path.read_text()) if path.exists() else None
        self.trackers = Trackers(
            self.train.report_to,
            self.workdir,
            name=self.workdir.resolve().name,
            config=self.config.model_dump(mode="json"),
            names=self.names,
            resumed=resumed,
        )
        write_replace(path, json.dumps(self.trackers.identities(), sort_keys=True).encode())
        return self.trackers

    def report(self, records: list[RoundRecord]) -> None:
        lines = "".join(
            json.dumps(record.model_dump(exclude_none=True), sort_keys=True) + "\n" for record in records
        )
        write_replace(self.workdir / LOG_FILE, lines.encode())
        plot_rounds(records, self.workdir / PLOT_FILE)

    def run_round(self, r: int) -> Path:
        folder = self.folder(r)
        folder.mkdir(parents=True, exist_ok=True)
        samples = folder / "samples.parquet"
        rollout = self.config.rollout
        assert rollout is not None
        self.sample(r, samples, prompts=rollout.prompts, student=self.student(r - 1))
        previous = self.folder(r - 1) / "run" if r > 1 else None
        config = self.config_for(
            self.mix(r, samples),
            folder / "store.zarr",
            folder / "run",
            init_from=previous,
            optimizer=self.rounds.carry_optimizer,
        )
        self.score(config)
        run = self.fit(config)
        self.export(r, run)
        return run


def plot_rounds(records: list[RoundRecord], out: Path) -> Path:
    """Held-out divergence per teacher against the round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    for teacher in sorted({t for r in records for t in r.heldout_by_teacher}):
        points = [
            (r.round, r.heldout_by_teacher[teacher]) for r in records if teacher in r.heldout_by_teacher
        ]
        ax.plot(*zip(*points, strict=True), "o-", label=teacher)
    ax.set(
        xlabel="round", ylabel="divergence per token", title="held-out divergence on the student's samples"
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    write_replace_with(out, lambda temp: fig.savefig(temp, format="png"))
    plt.close(fig)
    return out


def run_rounds(config: MopdConfig, *, log: Log = print) -> Path:
    """Runs (or continues) every round of `rounds`; returns the last round's run folder."""
    rounds = Rounds(config, log)
    rounds.check_settings()
    count = rounds.rounds.count
    with rounds.track():
        records = [record for record in [rounds.evaluate(0, run=None)] if record is not None]
        if records:
            rounds.report(records)
        run = Path()
        eta = Eta()
        for r in range(1, count + 1):
            log(f"round {r} of {count}")
            trained = not Path(rounds.student(r)).exists()  # else an earlier mopd rounds finished it
            start = time.perf_counter()
            run = rounds.run_round(r)
            record = rounds.evaluate(r, run=run)
            if record is not None:
                records.append(record)
                rounds.report(records)
            if trained:
                took = time.perf_counter() - start
                eta.add(took)
                left = eta.remaining(count - r)
                log(f"round {r} took {format_duration(took)}; eta {format_duration(left or 0)}")
    log(f"rounds done: the student of round {count} is {rounds.student(count)}")
    return run

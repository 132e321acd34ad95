"""Fault trials shared by the test suite (a few of each) and `scripts/fault-trials` (many of each).

Each trial breaks a real `mopd precompute` or `mopd train` process — SIGKILL at a named point of the
commit path or at a random moment, two jobs on one task, racing finalizers, an injected ENOSPC or EIO —
then reruns it and compares the outcome with an uninterrupted run: every store file's hash (the
manifest's volatile fields aside), or every step's loss and gradient norm bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mopd.base.fsio import file_digests, is_temporary
from mopd.store.format.manifest import MANIFEST_FILE
from mopd.store.format.provenance import INGEST_DIR, INGEST_RECORD
from mopd.store.locations.location import open_location
from mopd.train.report.metrics import METRICS_FILE, read_metrics
from tests.mopd_process import MopdProcess, run_mopd_process

REPO = Path(__file__).resolve().parents[1]
# Every kill point of a precompute's commit path, in the order a task passes them.
PRECOMPUTE_POINTS = (
    "task-written",
    "task-fsynced",
    "task-renamed",
    "part-written",
    "part-linked",
    "manifest-written",
    "manifest-linked",
)
CHECKPOINT_POINTS = ("checkpoint-written", "checkpoint-fsynced", "checkpoint-renamed", "checkpoint-retained")


def cli(args: list[str], *, fault: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`mopd ARGS` in a process of its own, with MOPD_FAULT set to `fault` (or unset)."""
    env = {k: v for k, v in os.environ.items() if k != "MOPD_FAULT"}
    if fault:
        env["MOPD_FAULT"] = fault
    return run_mopd_process(args, cwd=REPO, env={**env, "COLUMNS": "200"}, timeout=timeout)


def store_contents(store: Path | str, *, ingest_cache: bool = True) -> dict[str, Any]:
    """Every file's (size, sha256), temporaries left out; the manifest without its volatile fields.

    Args:
        ingest_cache: keep the tokenised rows a store on disk holds under `ingest/` (a store in a bucket
            holds only their records; the rows stay on the machine that tokenised them).
    """
    location = open_location(store)
    digests: dict[str, Any] = {
        path: value
        for path, value in location.digests("").items()
        if not any(is_temporary(part) for part in path.split("/"))
        and path != MANIFEST_FILE
        and (ingest_cache or not path.startswith(f"{INGEST_DIR}/") or path.endswith(f"/{INGEST_RECORD}"))
    }
    manifest = json.loads(location.read_record(MANIFEST_FILE, "manifest", limit=1 << 26))
    manifest.pop("volatile")
    digests[MANIFEST_FILE] = json.dumps(manifest, sort_keys=True)
    return digests


def stored_rows(store: Path | str) -> list[int]:
    """Every row id the store's shards hold, with repeats (0 lost and 0 duplicated: each row once)."""
    from mopd.store import open_store
    from mopd.store.format.layout import ROW_IDS

    opened = open_store(store)
    return sorted(int(r) for s in opened.manifest.shards for r in opened._array(s.path, ROW_IDS).read())


@dataclass(frozen=True)
class Outcome:
    trial: str
    identical: bool
    detail: str = ""


def precompute_args(config: Path, store: Path | str, *extra: str) -> list[str]:
    return ["precompute", str(config), "--store", str(store), *extra]


def precompute_in_process(config: Path, store: Path | str) -> tuple[int, str]:
    """`mopd precompute` in this process (no interpreter start-up): (exit code, stderr)."""
    from click.testing import CliRunner

    from mopd.cli.main import cli as mopd_cli

    result = CliRunner().invoke(mopd_cli, precompute_args(config, store))
    return result.exit_code, result.stderr


def finish_and_compare(
    trial: str, config: Path, store: Path | str, reference: dict[str, Any], *, in_process: bool = False
) -> Outcome:
    """Reruns the precompute without faults and compares the store with the reference."""
    if in_process:
        code, stderr = precompute_in_process(config, store)
    else:
        done = cli(precompute_args(config, store))
        code, stderr = done.returncode, done.stderr
    if code != 0:
        return Outcome(trial, False, f"rerun failed: {stderr[-500:]}")
    rows = stored_rows(store)
    if rows != sorted(set(rows)):
        return Outcome(trial, False, "rows stored twice")
    same = store_contents(store) == reference
    return Outcome(trial, same, "" if same else "store differs from the uninterrupted run")


def kill_at_point(config: Path, store: Path, point: str, k: int, reference: dict[str, Any]) -> Outcome:
    """SIGKILL at the k-th time the precompute reaches `point`, then rerun."""
    trial = f"kill@{point}:{k}"
    killed = cli(precompute_args(config, store), fault=trial)
    if killed.returncode != -signal.SIGKILL:
        return Outcome(trial, False, f"not killed (exit {killed.returncode}): {killed.stderr[-300:]}")
    return finish_and_compare(trial, config, store, reference)


def kill_at_random(
    config: Path,
    store: Path | str,
    rng: random.Random,
    seconds: float,
    ref: dict[str, Any],
    *,
    in_process: bool = False,
) -> Outcome:
    """SIGKILL after a random moment within the run's usual duration, then rerun."""
    delay = rng.uniform(0.2, seconds)
    proc = MopdProcess(precompute_args(config, store), cwd=REPO)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    return finish_and_compare(f"sigkill after {delay:.2f} s", config, store, ref, in_process=in_process)


def two_jobs_at_once(config: Path, store: Path | str, reference: dict[str, Any]) -> Outcome:
    """Two jobs started together on the same tasks (a requeue, a duplicated array index): each task is
    published once, one manifest, which only the job that published it says it wrote; the reference
    store."""
    procs = [MopdProcess(precompute_args(config, store), cwd=REPO) for _ in range(2)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    if any(p.returncode != 0 for p in procs):
        return Outcome("two jobs", False, " | ".join(e[-300:] for e in errors))
    written = sum("manifest written" in e for e in errors)
    if written != 1:
        return Outcome("two jobs", False, f"{written} jobs say they wrote the manifest")
    same = store_contents(store) == reference and stored_rows(store) == sorted(set(stored_rows(store)))
    return Outcome("two jobs", same)


def racing_finalizers(config: Path, store: Path, reference: dict[str, Any]) -> Outcome:
    """A store whose every task is done but not finalized; two jobs finalize it at once."""
    done = cli(precompute_args(config, store), fault="kill@manifest-written")
    if done.returncode != -signal.SIGKILL:
        return Outcome("racing finalizers", False, "setup run was not killed before its manifest")
    return two_jobs_at_once(config, store, reference)


ERRNO_REASONS = {"enospc": "No space left on device", "eio": "Input/output error"}


def _inject(fault: str) -> Any:
    """A context in which this process's MOPD_FAULT is `fault` (counted from zero)."""
    from contextlib import contextmanager

    from mopd.base import faults

    @contextmanager
    def scope() -> Any:
        old = os.environ.get(faults.VARIABLE)
        os.environ[faults.VARIABLE] = fault
        faults.reset()
        try:
            yield
        finally:
            if old is None:
                del os.environ[faults.VARIABLE]
            else:
                os.environ[faults.VARIABLE] = old

    return scope()


def one_line_error(stderr: str, op: str, code: str, k: int) -> str | None:
    """The problem with a failed command's stderr, or None when it is the one expected line."""
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    expected = f"error: {op} failed: {ERRNO_REASONS[code]} (injected at {op} #{k}): "
    if len(lines) != 1 or "Traceback" in stderr or not lines[0].startswith(expected):
        return f"not one line naming the operation: {stderr[-400:]}"
    return None


def published_folders_complete(store: Path, reference: dict[str, Any]) -> bool:
    """Every task folder under its final name holds exactly the reference's files for it."""
    from mopd.store.format.loading import load_plan

    if not (store / "_plan.json").exists():
        return True
    for task in load_plan(store).tasks:
        if (store / task.path).exists():
            found = {f"{task.path}/{rel}": value for rel, value in file_digests(store / task.path).items()}
            expected = {p: v for p, v in reference.items() if p.startswith(task.path + "/")}
            if found != expected:
                return False
    return True


def io_error_in_precompute(
    config: Path, store: Path, code: str, op: str, k: int, reference: dict[str, Any]
) -> Outcome:
    """The k-th `op` of an in-process precompute fails with `code`: one line naming the operation and
    path, exit 1, no temporary and no manifest left, published folders complete; then a rerun."""
    trial = f"{code}@{op}:{k}"
    with _inject(trial):
        result_code, stderr = precompute_in_process(config, store)
    problem = one_line_error(stderr, op, code, k) if result_code == 1 else f"exit {result_code}"
    if problem is None and store.exists():
        if (store / MANIFEST_FILE).exists():
            problem = "a manifest was published"
        elif [p for p in store.rglob("*") if is_temporary(p.name)]:
            problem = "temporaries were left"
        elif not published_folders_complete(store, reference):
            problem = "a partial task folder was published"
    if problem is not None:
        return Outcome(trial, False, problem)
    return finish_and_compare(trial, config, store, reference, in_process=True)


def train_in_process(config: Path, run: Path, *extra: str) -> tuple[int, str]:
    from click.testing import CliRunner

    from mopd.cli.main import cli as mopd_cli

    result = CliRunner().invoke(mopd_cli, ["train", str(config), "--output", str(run), *extra])
    return result.exit_code, result.stderr


def io_error_in_checkpoint(
    config: Path, run: Path, code: str, op: str, k: int, whole: list[dict[str, Any]], *, first: int = 2
) -> Outcome:
    """A run trained to step `first` resumes with the k-th `op` of its checkpoint saves failing: one
    line naming the operation and path, exit 1, the step-`first` checkpoint intact, nothing partial
    published; resumed again without the fault it ends as the uninterrupted run."""
    from mopd.base.completion import check_complete
    from mopd.train.checkpoint.state import complete_checkpoints

    trial = f"checkpoint {code}@{op}:{k}"
    if train_in_process(config, run, "--max-steps", str(first))[0] != 0:
        return Outcome(trial, False, "the first part did not train")
    with _inject(f"{code}@{op}:{k}"):
        result_code, stderr = train_in_process(config, run)
    problem = one_line_error(stderr, op, code, k) if result_code == 1 else f"exit {result_code}"
    checkpoints = complete_checkpoints(run / "checkpoints")
    if problem is None and (not checkpoints or checkpoints[0].name != f"step_{first:08d}"):
        problem = "the checkpoint before the fault is gone"
    if problem is None and any(check_complete(c) for c in checkpoints):
        problem = "a checkpoint is partial or damaged"
    if problem is not None:
        return Outcome(trial, False, problem)
    if train_in_process(config, run)[0] != 0:
        return Outcome(trial, False, "the resumed run failed")
    return compare_runs(trial, run, whole)


def two_teacher_config(root: Path, tiny_teachers: dict[str, Path]) -> Path:
    """A config of two teachers (the tiny llama and qwen2) over 12 rows, 3 rows per task: 8 tasks."""
    from tests.precompute.teachers import mixed_records, write_jsonl

    records = [{**r, "agent": "math" if i % 3 else "code"} for i, r in enumerate(mixed_records(12))]
    data = write_jsonl(root / "d.jsonl", records)
    return write_precompute_config(
        root, {"math": tiny_teachers["llama"], "code": tiny_teachers["qwen2"]}, data
    )


def write_precompute_config(root: Path, teachers: dict[str, Path], data: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    raw = {
        "teachers": {alias: str(path) for alias, path in teachers.items()},
        "data": {"path": str(data), "max_length": 96},
        "store": {"path": str(root / "store.zarr"), "dtype": "float32"},
        "precompute": {"rows_per_task": 3, "batch_tokens": 256, "dtype": "float32"},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(raw))
    return root / "config.yaml"


def train_records(run: Path) -> list[dict[str, Any]]:
    """Training lines of metrics.jsonl: (step, loss, grad_norm) checked; eval lines left out."""
    return [r for r in read_metrics(run / METRICS_FILE) if r.get("split", "train") == "train"]


def compare_runs(trial: str, run: Path, reference: list[dict[str, Any]]) -> Outcome:
    got = train_records(run)
    steps = [r["step"] for r in got]
    if steps != [r["step"] for r in reference]:
        return Outcome(trial, False, f"steps {steps}")
    for a, b in zip(got, reference, strict=True):
        if (a["loss"], a["grad_norm"]) != (b["loss"], b["grad_norm"]):
            return Outcome(trial, False, f"step {a['step']}: {a['loss']!r} vs {b['loss']!r}")
    leftovers = [p.name for p in (run / "checkpoints").iterdir() if is_temporary(p.name)]
    if leftovers:
        return Outcome(trial, False, f"temporaries left: {leftovers}")
    return Outcome(trial, True)


def kill_training(config: Path, run: Path, *, when: str, rng: random.Random) -> int:
    """Starts `mopd train` and SIGKILLs it: `when` is a kill point (`checkpoint-written:2`) or
    `step:N` (killed a random moment after step N's metrics line). Returns the process's exit code."""
    args = ["train", str(config), "--output", str(run)]
    if not when.startswith("step:"):
        return cli(args, fault=f"kill@{when}").returncode
    after = int(when.split(":")[1])
    proc = MopdProcess(args, cwd=REPO)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if (run / METRICS_FILE).exists() and len(train_records(run)) >= after:
            time.sleep(rng.uniform(0.0, 0.05))
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    return proc.wait(timeout=30)


def resume(config: Path, run: Path) -> subprocess.CompletedProcess:
    return cli(["train", str(config), "--output", str(run)])

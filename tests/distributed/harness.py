"""The one multi-process harness: gloo ranks in fresh processes, a file rendezvous, a timeout that names
the hung rank, and nothing left running afterwards.

    results = run_distributed(worker, world_size=2, args=(x,))

`worker(rank, world_size, *args)` runs in a new process (forked from the test session's forkserver,
`tests.forked`) with the default process group initialised (gloo, `file://` rendezvous in a private temp
folder, so no free-port races); its return value (picklable) comes back to the parent in rank order,
where the test compares them. When it returns, every rank and every process a rank started has ended.

    log = run_mopd(["train", config], nproc=4)

runs a `mopd` command on such ranks as `torchrun --nproc-per-node 4` would (torchrun's variables set, a
failing rank stopping the others), without a launcher and a new interpreter per rank; `run_torchrun`
is the real launcher, for the tests of launching itself.
"""

from __future__ import annotations

import os
import pickle
import queue
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests.forked import CONTEXT, end_groups, start

# How long a rank that has sent its result gets to end by itself, running its exit handlers (which stop
# what it started: megatron-core's checkpoint writer keeps a multiprocessing manager per rank); then its
# whole process group is ended.
EXIT_GRACE_S = 3.0


def _entry(
    worker: Callable[..., Any], rank: int, world_size: int, init_file: str, args: tuple, results: Any
) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            value = worker(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle copies tensor data into the message; the queue's own pickler would pass shared
        # memory handles that die with this process.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


@dataclass
class _Outcome:
    results: dict[int, tuple[str, Any]]  # rank → ("ok", pickled value) or ("error", traceback)
    died: dict[int, int]  # rank → exit code, for ranks that ended without a result
    hung: list[int]  # ranks without a result at the timeout


def _run_world(
    worker: Callable[..., Any],
    world_size: int,
    args: tuple,
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    stops: Callable[[str, Any], bool] = lambda status, _value: status == "error",
) -> _Outcome:
    """Runs the ranks until each has a result, one has a result that `stops` the world, one died, or
    the timeout; then ends every rank (and what it started)."""
    results = CONTEXT.Queue()
    outcome = _Outcome({}, {}, [])
    with tempfile.TemporaryDirectory() as folder:
        init_file = str(Path(folder) / "rendezvous")
        # One thread per rank unless the test's environment says otherwise: the ranks share the cores.
        rank_env = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {})}
        procs = [
            start(_entry, (worker, r, world_size, init_file, args, results), env=rank_env)
            for r in range(world_size)
        ]
        deadline = time.monotonic() + timeout
        grace = EXIT_GRACE_S
        try:
            while len(outcome.results) < world_size:
                try:
                    rank, status, value = results.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                except queue.Empty:
                    outcome.died = {
                        r: p.exitcode
                        for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in outcome.results
                    }
                    if outcome.died:
                        break
                    if time.monotonic() >= deadline:
                        outcome.hung = [r for r in range(world_size) if r not in outcome.results]
                        break
                    continue
                outcome.results[rank] = (status, value)
                if stops(status, value):
                    break
            if len(outcome.results) < world_size:
                grace = 0.0  # the others wait on the stopped rank's collectives
        except BaseException:
            grace = 0.0
            raise
        finally:
            end_groups(procs, grace)
    return outcome


def run_distributed(
    worker: Callable[..., Any], *, world_size: int = 2, args: tuple = (), timeout: float = 60.0
) -> list[Any]:
    """Runs `worker` on `world_size` gloo ranks and returns their results in rank order. Every rank, and
    every process a rank started, has ended when it returns.

    Raises:
        AssertionError: a rank raised (its traceback is included), died, or "rank r hung" on timeout.
    """
    outcome = _run_world(worker, world_size, args, timeout=timeout)
    errors = {r: v for r, (s, v) in outcome.results.items() if s == "error"}
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
    if outcome.died:
        rank = min(outcome.died)
        raise AssertionError(f"rank {rank} died with exit code {outcome.died[rank]}")
    if outcome.hung:
        raise AssertionError(f"rank {outcome.hung[0]} hung (no result after {timeout:.0f} s)")
    return [pickle.loads(outcome.results[r][1]) for r in range(world_size)]


def _mopd_rank(rank: int, world_size: int, args: list[str], logs: str) -> int:
    """`mopd ARGS` as a torchrun worker runs it (its variables set; the process group, which mopd finds
    initialised, is the harness's), its stderr into LOGS/rank<r>.log; the exit code."""
    from mopd.cli.main import cli

    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    with open(Path(logs) / f"rank{rank}.log", "w") as log:
        sys.stderr.flush()
        os.dup2(log.fileno(), 2)  # what the process writes to its stderr, C libraries included
        try:
            cli.main(args=args, prog_name="mopd")
            return 0
        except SystemExit as done:
            return done.code if isinstance(done.code, int) else int(done.code is not None)
        except BaseException:  # what a worker prints when an error escapes it
            traceback.print_exc()
            return 1
        finally:
            sys.stderr.flush()


def run_mopd(
    mopd_args: list[str],
    *,
    nproc: int,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    fails: bool = False,
) -> str:
    """`mopd ARGS` on `nproc` gloo ranks, as `torchrun --nproc-per-node N -m mopd.cli ARGS` runs it (one
    thread per rank unless OMP_NUM_THREADS says otherwise, `env` added to the environment; a rank that
    fails or dies stops the others, as torchrun's agent does); returns every rank's stderr, in rank
    order.

    Raises:
        AssertionError: a rank failed, died or hung (with the first traceback and the end of the logs);
            with `fails`, every rank succeeded (a failing run returns).
    """
    with tempfile.TemporaryDirectory() as logs:
        outcome = _run_world(
            _mopd_rank,
            nproc,
            (mopd_args, logs),
            timeout=timeout,
            env=env,
            stops=lambda status, value: status == "error" or pickle.loads(value) != 0,
        )
        log = "".join(
            (Path(logs) / f"rank{r}.log").read_text() if (Path(logs) / f"rank{r}.log").exists() else ""
            for r in range(nproc)
        )
    codes = {r: pickle.loads(v) for r, (s, v) in outcome.results.items() if s == "ok"}
    failed = outcome.died or outcome.hung or any(codes.values()) or len(codes) < nproc
    if fails:
        if not failed:
            raise AssertionError(f"mopd succeeded on every rank, a failure was expected:\n{log[-2000:]}")
        return log
    if failed:
        summary = f"exit codes {codes}, died {outcome.died}, hung {outcome.hung}"
        raise AssertionError(f"mopd failed ({summary})\n{first_failure(log)}\n...\n{log[-2000:]}")
    return log


def run_torchrun(
    mopd_args: list[str],
    *,
    nproc: int,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    fails: bool = False,
) -> str:
    """`torchrun --standalone --nproc-per-node N -m mopd.cli ARGS` (one thread per rank unless
    OMP_NUM_THREADS says otherwise, `env` added to the environment); returns its stderr (where mopd logs).

    Raises:
        AssertionError: the launch failed (with the first traceback, usually the failing rank's own,
            and the end of the output); with `fails`, the launch succeeded (a failing one returns).
    """
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    with subprocess.Popen(
        [*launch, "-m", "mopd.cli", *mopd_args],
        env={"OMP_NUM_THREADS": "1", **os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # torchrun starts each worker in a session of its own: a SIGKILLed launcher would leave them
            # running. On SIGTERM it stops them first.
            proc.terminate()
            try:
                proc.communicate(timeout=30)
            finally:
                proc.kill()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if fails:
        if done.returncode == 0:
            raise AssertionError(f"torchrun succeeded, a failure was expected:\n{done.stderr[-2000:]}")
        return done.stderr
    if done.returncode != 0:
        raise AssertionError(
            f"torchrun exited {done.returncode}\n{first_failure(done.stderr)}\n...\n{done.stderr[-2000:]}"
        )
    return done.stderr


def first_failure(log: str) -> str:
    """The end of the first traceback in a torchrun log, through its exception line: usually the rank
    that failed first, the others failing after it with lost connections."""
    start = log.find("Traceback")
    if start < 0:
        return ""
    raised = re.compile(r"^(\[rank\d+\]: )?[\w.]+(Error|Exception|Exit)\b.*$", re.MULTILINE)
    end = raised.search(log, start)
    stop = end.end() if end else len(log)
    return log[max(start, stop - 3000) : stop]

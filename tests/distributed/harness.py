"""The one multi-process harness: fresh rank processes, gloo, a file rendezvous, a timeout that names the
hung rank, and nothing left running afterwards.

    results = run_distributed(worker, world_size=2, args=(x,))

`worker(rank, world_size, *args)` runs in a new process with the default process group initialised
(gloo, `file://` rendezvous in a private temp folder, so no free-port races); its return value
(picklable) comes back to the parent in rank order, where the test compares them.

Ranks are forked from a forkserver that has imported torch, transformers, megatron-core and mopd once
(`PRELOAD`): a new rank is a clean process (the server never computes, holds no thread and no process
group) that starts in milliseconds instead of the 2–4 s those imports take in every spawned process —
the suite starts a few hundred ranks. What the server cannot know is applied in each rank: the
environment and working folder the test has when it calls, and torch's thread count.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Imported once by the forkserver (megatron-core only where it is installed: the `megatron` extra).
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "mopd.train.trainer",
    "mopd.precompute.runner",
    *(["megatron.core"] if importlib.util.find_spec("megatron") else []),
    "tests.distributed.harness",
]
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)
# How long a rank that has sent its result gets to end by itself, running its exit handlers (which stop
# what it started: megatron-core's checkpoint writer keeps a multiprocessing manager process per rank);
# after that its whole process group is ended.
EXIT_GRACE_S = 3.0


def _entry(
    worker: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    environment: dict[str, str],
    args: tuple,
    results: Any,
) -> None:
    # Its own process group: whatever the rank starts can be ended with it (`_end`).
    os.setpgrp()
    os.environ.clear()
    os.environ.update({"OMP_NUM_THREADS": "1", **environment})
    # A spawned process sizes torch's thread pool from OMP_NUM_THREADS when it imports torch; the server
    # imported torch before this rank's environment existed.
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
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


def _end(procs: list[Any], grace: float) -> None:
    """Waits up to `grace` seconds for the ranks to end by themselves, then ends each rank's whole
    process group: first SIGTERM (a trainer stops gracefully), SIGKILL 5 s later."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if _group_alive(p.pid)]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + wait
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
            while _group_alive(p.pid) and time.monotonic() < deadline:
                time.sleep(0.05)


def _group_alive(pgid: int | None) -> bool:
    if pgid is None:
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def run_distributed(
    worker: Callable[..., Any], *, world_size: int = 2, args: tuple = (), timeout: float = 60.0
) -> list[Any]:
    """Runs `worker` on `world_size` gloo ranks and returns their results in rank order. Every rank, and
    every process a rank started, has ended when it returns.

    Raises:
        AssertionError: a rank raised (its traceback is included), or "rank r hung" on timeout.
    """
    results = _CONTEXT.Queue()
    environment = dict(os.environ)
    with tempfile.TemporaryDirectory() as folder:
        init_file = str(Path(folder) / "rendezvous")
        # Not daemonic: what a rank runs may start processes of its own (megatron-core's checkpoint
        # writer forks one per file); `_end` below ends every rank and its group however the run ends.
        procs = [
            _CONTEXT.Process(
                target=_entry, args=(worker, r, world_size, init_file, environment, args, results)
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outcome: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        grace = EXIT_GRACE_S
        try:
            while len(outcome) < world_size:
                try:
                    rank, status, value = results.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                    outcome[rank] = (status, value)
                    if status == "error":
                        grace = 0.0  # the others wait on the failed rank's collectives
                        break
                except queue.Empty:
                    dead = [
                        r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcome
                    ]
                    if dead:
                        code = procs[dead[0]].exitcode
                        raise AssertionError(f"rank {dead[0]} died with exit code {code}") from None
                    if time.monotonic() >= deadline:
                        hung = [r for r in range(world_size) if r not in outcome]
                        raise AssertionError(
                            f"rank {hung[0]} hung (no result after {timeout:.0f} s)"
                        ) from None
        except BaseException:
            grace = 0.0
            raise
        finally:
            _end(procs, grace)
    errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]


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

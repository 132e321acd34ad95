"""The one multi-process harness: spawn, gloo, a file rendezvous, a timeout that names the hung rank.

    results = run_distributed(worker, world_size=2, args=(x,))

`worker(rank, world_size, *args)` runs in a fresh spawned process with the default process group
initialised (gloo, `file://` rendezvous in a private temp folder, so no free-port races); its return
value (picklable) comes back to the parent in rank order, where the test compares them.
"""

from __future__ import annotations

import multiprocessing as mp
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
from pathlib import Path
from typing import Any

import torch.distributed as dist


def _entry(
    worker: Callable[..., Any], rank: int, world_size: int, init_file: str, args: tuple, results: Any
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
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


def run_distributed(
    worker: Callable[..., Any], *, world_size: int = 2, args: tuple = (), timeout: float = 60.0
) -> list[Any]:
    """Runs `worker` on `world_size` gloo ranks and returns their results in rank order.

    Raises:
        AssertionError: a rank raised (its traceback is included), or "rank r hung" on timeout.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = str(Path(folder) / "rendezvous")
        # Not daemonic: what a rank runs may start processes of its own (megatron-core's checkpoint
        # writer forks one per file); the `finally` below ends every rank however the run ends.
        procs = [
            ctx.Process(target=_entry, args=(worker, r, world_size, init_file, args, results))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outcome: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outcome) < world_size:
                try:
                    rank, status, value = results.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                    outcome[rank] = (status, value)
                    if status == "error":
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
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(5)
                if p.is_alive():  # it handles SIGTERM (a trainer's graceful stop) or waits on a thread
                    p.kill()
                    p.join()
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
    done = subprocess.run(
        [*launch, "-m", "mopd.cli", *mopd_args],
        env={"OMP_NUM_THREADS": "1", **os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
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

"""Fresh processes for the tests, started in milliseconds: the one forkserver of a test session.

Every process a test starts to run mopd code (a gloo rank of `tests.distributed.harness`, a `mopd`
command in `tests.mopd_process`) is forked from a forkserver that imported torch, transformers,
megatron-core and mopd once (`PRELOAD`). Such a process is as clean as a spawned one — the server never
computes, holds no thread and no process group — but starts without the 2–4 s those imports take in
every new interpreter; the suite starts a few hundred of them.

What the server cannot know is applied in each process (`_prepare`): the environment the test has when
it starts the process (the server's is the one of the moment it started), its stdout and stderr (pytest
captures each test's output in files of its own), torch's thread count (a new interpreter sizes it from
OMP_NUM_THREADS when it imports torch) and a process group of its own, so that whatever the process
starts can be ended with it (`end_groups`). The working folder and `sys.path` come with
multiprocessing's own preparation data.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from multiprocessing.process import BaseProcess
from typing import Any

import torch

PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "mopd.cli.main",
    "mopd.train.trainer",
    "mopd.precompute.runner",
    *(["megatron.core"] if importlib.util.find_spec("megatron") else []),  # the `megatron` extra
    "tests.forked",
]
CONTEXT = mp.get_context("forkserver")
# Set before any process starts the server (tests/conftest.py imports this module): the preload is fixed
# when the server starts.
CONTEXT.set_forkserver_preload(PRELOAD)


class _Stream:
    """One of this process's file descriptors as it is when the child starts, duplicated into the child
    (sent through the forkserver's socket)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Callable[..., int], tuple[Any]]:
        return _detach, (reduction.DupFd(self.fd),)


def _detach(duplicate: Any) -> int:
    return int(duplicate.detach())


def _prepare(environment: dict[str, str], streams: tuple[int, int]) -> None:
    os.setpgrp()
    for fd, inherited in zip((1, 2), streams, strict=True):
        os.dup2(inherited, fd)
        os.close(inherited)
    os.environ.clear()
    os.environ.update(environment)
    if "OMP_NUM_THREADS" in environment:
        torch.set_num_threads(int(environment["OMP_NUM_THREADS"]))


def _run(
    target: Callable[..., Any], environment: dict[str, str], streams: tuple[int, int], args: tuple
) -> Any:
    _prepare(environment, streams)
    return target(*args)


def start(target: Callable[..., Any], args: tuple = (), *, env: dict[str, str] | None = None) -> BaseProcess:
    """Starts `target(*args)` in a new process forked from the server, with the environment `env` (as
    `subprocess`'s: the whole environment; by default this process's) and this process's working folder.
    Not daemonic: the target may start processes of its own.
    """
    environment = dict(os.environ if env is None else env)
    streams = (_Stream(1), _Stream(2))
    process = CONTEXT.Process(target=_run, args=(target, environment, streams, args))
    process.start()
    return process


def group_alive(pgid: int | None) -> bool:
    if pgid is None:
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def end_groups(processes: Sequence[BaseProcess], grace: float) -> None:
    """Waits up to `grace` seconds for the processes to end by themselves (running their exit handlers,
    which stop what they started), then ends each one's whole process group: SIGTERM first (a trainer
    stops gracefully), SIGKILL 5 s later."""
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in processes if p.is_alive() or group_alive(p.pid)]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                if group_alive(p.pid):
                    os.killpg(p.pid, sig)  # type: ignore[arg-type]
                else:
                    os.kill(p.pid, sig)  # type: ignore[arg-type]
        deadline = time.monotonic() + 5.0
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
            while group_alive(p.pid) and time.monotonic() < deadline:
                time.sleep(0.05)

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_distributed
from tests.test_processes import gone

pytestmark = pytest.mark.distributed


def _all_reduce(rank: int, world_size: int, base: float) -> list[float]:
    t = torch.full((3,), base + rank)
    dist.all_reduce(t)
    return t.tolist()


def _rank_one_hangs(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(60)
    dist.barrier()


def _rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("boom on rank 1")


def _lingers(rank: int, world_size: int) -> int:
    """Returns, but its process does not end: SIGTERM is ignored and a thread keeps it alive."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=time.sleep, args=(3600,)).start()
    return os.getpid()


_KEPT: list[object] = []


def _keeps_a_manager(rank: int, world_size: int) -> int:
    """What megatron-core's checkpoint writer does: a multiprocessing manager (a process of its own)
    kept for the rank's lifetime."""
    import multiprocessing

    manager = multiprocessing.get_context("spawn").Manager()
    _KEPT.append(manager)
    return manager._process.pid  # type: ignore[attr-defined]


def _starts_a_sleeper(rank: int, world_size: int) -> int:
    """A child that nothing ends: the rank returns and leaves it running."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    _KEPT.append(child)
    return child.pid


@pytest.mark.parametrize("worker", [_keeps_a_manager, _starts_a_sleeper])
def test_nothing_a_rank_started_outlives_the_run(worker: Callable[[int, int], int]) -> None:
    """A rank's own children end with it: those its exit handlers stop (the manager) and those they do
    not (its process group is ended)."""
    (pid,) = run_distributed(worker, world_size=1, timeout=60)
    assert gone(pid)


def test_no_rank_outlives_the_run() -> None:
    (pid,) = run_distributed(_lingers, world_size=1, timeout=30)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_results_come_back_in_rank_order() -> None:
    results = run_distributed(_all_reduce, world_size=2, args=(1.0,))
    assert results == [[3.0, 3.0, 3.0]] * 2


def _speaks(rank: int, world_size: int) -> bool:
    # Each line in one write: print() writes its text and its end separately, so two ranks' lines could
    # interleave on the shared output ("rank 1 on stdoutrank 0 on stdout").
    for stream, name in ((sys.stdout, "stdout"), (sys.stderr, "stderr")):
        stream.write(f"rank {rank} on {name}\n")
        stream.flush()
    return os.getpgrp() == os.getpid()


def test_ranks_write_into_the_tests_output_in_process_groups_of_their_own(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """What a rank prints is the calling test's output (shown when it fails), wherever the forkserver
    started; each rank leads a process group (what it starts is ended with it)."""
    assert run_distributed(_speaks, world_size=2) == [True, True]
    out, err = capfd.readouterr()
    assert {"rank 0 on stdout", "rank 1 on stdout"} <= set(out.splitlines())
    assert {"rank 0 on stderr", "rank 1 on stderr"} <= set(err.splitlines())


def test_hang_names_the_rank() -> None:
    with pytest.raises(AssertionError, match=r"rank [01] hung"):
        run_distributed(_rank_one_hangs, world_size=2, timeout=8)


def test_failure_carries_traceback() -> None:
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed:.*boom on rank 1"):
        run_distributed(_rank_one_raises, world_size=2, timeout=30)

"""A pytest plugin: the test session fails when a process it started is still alive at its end.

A test that leaves a process behind (a rank's helper, a server, a killed job's child) makes later runs
slower and fills machines; once its parent has exited such a process is reparented to init and nothing
shows where it came from. So each pytest process (the one process, or each xdist worker) makes itself a
child subreaper (Linux `prctl(PR_SET_CHILD_SUBREAPER)`): orphans of everything it started are reparented
to it rather than to init. When its session ends it waits a few seconds for its descendants to end, and
lists the survivors — with the test each was started under (`PYTEST_CURRENT_TEST`, which children
inherit) — as an error that fails the run, then ends them.

Multiprocessing's own helpers of the pytest process (its resource tracker and forkserver) are left out:
they end when the pytest process does, unless something else still holds their pipe, which a survivor
listed here would be.

Registered by tests/conftest.py; `tests/test_processes.py` shows it failing a session that leaks.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PR_SET_CHILD_SUBREAPER = 36
# How long the descendants get to end once the last test is done (a killed job's processes, a server
# the last fixture stopped).
SETTLE_S = 5.0


@dataclass(frozen=True)
class Survivor:
    pid: int
    command: str
    test: str  # the test it was started under, or "" outside any test

    def __str__(self) -> str:
        started = f"started by {self.test}" if self.test else "started outside a test"
        return f"pid {self.pid} ({started}): {self.command}"


def become_subreaper() -> None:
    """Orphaned descendants of this process are reparented to it, not to init (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _parents() -> dict[int, tuple[int, str]]:
    """Every process's (parent pid, state letter), from /proc."""
    found: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        # "pid (command) state ppid ...": the command may hold spaces and parentheses.
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        found[int(entry.name)] = (int(ppid), state)
    return found


def live_descendants(root: int) -> list[int]:
    """The pids of `root`'s descendants that have not ended (zombies left out)."""
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _state) in parents.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        if parents[pid][1] != "Z":
            found.append(pid)
    return sorted(found)


def _reap_zombies() -> None:
    """Collects the exit status of ended orphans reparented to this process."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _describe(pid: int) -> Survivor | None:
    proc = Path("/proc") / str(pid)
    try:
        command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        environment = (proc / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    test = next(
        (
            v.decode(errors="replace")
            for k, _, v in (e.partition(b"=") for e in environment)
            if k == b"PYTEST_CURRENT_TEST"
        ),
        "",
    )
    return Survivor(pid, command[:300], test)


def _own_helpers() -> set[int]:
    """This process's multiprocessing resource tracker and forkserver (they end with it)."""
    from multiprocessing import forkserver, resource_tracker

    pids = {
        getattr(resource_tracker._resource_tracker, "_pid", None),
        getattr(forkserver._forkserver, "_forkserver_pid", None),
    }
    return {pid for pid in pids if pid is not None}


def survivors(settle: float = SETTLE_S) -> list[Survivor]:
    """This process's descendants still alive after up to `settle` seconds, its own helpers left out."""
    deadline = time.monotonic() + settle
    while True:
        _reap_zombies()
        helpers = _own_helpers()
        alive = [pid for pid in live_descendants(os.getpid()) if pid not in helpers]
        # A helper's own children (the forkserver's ranks) are survivors; the helpers themselves not.
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    return [s for s in map(_describe, alive) if s is not None]


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_session() -> Iterator[None]:
    """Set up before every other session fixture, so torn down after them: what they started has been
    stopped when the check runs."""
    if not sys.platform.startswith("linux"):
        raise pytest.UsageError("the test suite's process check needs Linux (/proc, prctl)")
    become_subreaper()
    yield
    left = survivors()
    if left:
        for survivor in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(survivor.pid, signal.SIGKILL)
        time.sleep(0.5)
        _reap_zombies()
        lines = "\n  ".join(map(str, left))
        pytest.fail(
            f"{len(left)} process(es) started by the test session outlived it (now ended):\n  {lines}"
        )

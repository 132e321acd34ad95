"""Faults on demand for the commit path, so that tests show what a crash or a full disk leaves behind.

Off unless the environment variable MOPD_FAULT is set; read only by the commit code (base/fsio.py,
store/arrays/write.py, store/writer.py, train/checkpoint/state.py):

    MOPD_FAULT=kill@shard-renamed       SIGKILL this process when it first reaches the named point
    MOPD_FAULT=kill@checkpoint-written:2   ... the second time it reaches it
    MOPD_FAULT=enospc@fsync:3           the 3rd fsync of this process fails with ENOSPC (or eio@...)

Points: `<what>-written` (a shard, checkpoint or record's bytes are on disk, not yet durable),
`<what>-fsynced`, `<what>-renamed` (published), `<what>-linked` (a record created no-clobber), for
`what` in shard, part, manifest, checkpoint; `checkpoint-shards-written` (every rank of a sharded
student has written its shards, none of the checkpoint's own files yet); and `samples-renamed` (a
rollout's part of samples is published). Operations: write, fsync, rename, link.
"""

from __future__ import annotations

import errno
import os
import re
import signal
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

VARIABLE = "MOPD_FAULT"
_ERRNOS = {"enospc": errno.ENOSPC, "eio": errno.EIO}
_seen: Counter[str] = Counter()
_spec_seen = ""


def _spec() -> tuple[str, str, int] | None:
    """(action, target, k) of MOPD_FAULT, counting afresh whenever its value changes."""
    global _spec_seen
    raw = os.environ.get(VARIABLE, "")
    if raw != _spec_seen:
        _spec_seen = raw
        _seen.clear()
    if not raw:
        return None
    action, _, target = raw.partition("@")
    name, _, k = target.partition(":")
    return action, name, int(k or 1)


def reset() -> None:
    """Counts afresh from now (for callers that set MOPD_FAULT to the same value twice in one process)."""
    _seen.clear()


def point(name: str) -> None:
    """A named kill point: SIGKILL here when MOPD_FAULT says so (the k-th time this process gets here)."""
    spec = _spec()
    if spec is None or spec[0] != "kill" or spec[1] != name:
        return
    _seen[name] += 1
    if _seen[name] == spec[2]:
        os.kill(os.getpid(), signal.SIGKILL)


def _inject(op: str, path: object) -> None:
    spec = _spec()
    if spec is None or spec[0] not in _ERRNOS or spec[1] != op:
        return
    _seen[op] += 1
    if _seen[op] == spec[2]:
        code = _ERRNOS[spec[0]]
        raise OSError(code, f"{os.strerror(code)} (injected at {op} #{spec[2]})", str(path))


# Libraries that wrap an OSError in their own exception say its number so (safetensors' Rust I/O).
_WRAPPED_OS_ERROR = re.compile(r"\(os error (\d+)\)")


@contextmanager
def io(op: str, path: object, *, unnamed_only: bool = False) -> Iterator[None]:
    """One file-system operation of the commit path; an OSError from it names the operation and path.

    An OSError a library wrapped in its own exception (safetensors' `SafetensorError`) is unwrapped
    into one. With `unnamed_only`, an OSError that names its own file passes unchanged: for a block of
    work whose buffered writes (arrow, datasets) fail without naming their file, among reads that name
    theirs. Also where MOPD_FAULT's injected errors come from.
    """
    try:
        _inject(op, path)
    except OSError as err:
        raise OSError(err.errno, f"{op} failed: {err.strerror}", err.filename) from err
    try:
        yield
    except OSError as err:
        if (err.strerror and err.strerror.startswith(f"{op} failed")) or (unnamed_only and err.filename):
            raise
        reason = err.strerror or str(err)
        if err.errno and not reason.startswith(os.strerror(err.errno)):  # pyarrow's wordy own text
            reason = os.strerror(err.errno)
        raise OSError(err.errno, f"{op} failed: {reason}", err.filename or str(path)) from err
    except Exception as err:
        found = _WRAPPED_OS_ERROR.search(str(err))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, f"{op} failed: {os.strerror(code)}", str(path)) from err

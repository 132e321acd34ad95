"""`mopd ARGS` in a process of its own, for the tests that wait for a command, read its output, or kill
it at a chosen moment.

    done = run_mopd_process(["precompute", str(config)])            # as subprocess.run(capture_output)
    job = MopdProcess(["train", str(config)]); ...; job.send_signal(signal.SIGKILL); job.wait()

The process is forked from the session's forkserver (`tests.forked`), which imported mopd once: the same
command as `python -m mopd.cli ARGS` in a new interpreter, a real process (its own pid, signals, exit
code, open files), without the 2–4 s of imports. Its stdout and stderr go to files read back after it
ends; once it has ended, whatever it started and left behind (its process group) is ended too, as a
job scheduler ends a job.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.forked import end_groups, start


def _main(args: list[str], outputs: str, cwd: str | None) -> None:
    from mopd.cli.main import cli

    if cwd is not None:
        os.chdir(cwd)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        with open(Path(outputs) / name, "w") as file:
            os.dup2(file.fileno(), fd)
    sys.argv = ["mopd", *args]
    cli.main(args=args, prog_name="mopd")  # exits: its SystemExit's code is the process's exit code


class MopdProcess:
    """A running `mopd ARGS` with the part of `subprocess.Popen`'s interface the tests use."""

    def __init__(
        self, args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.args = ["mopd", *args]
        self._outputs = tempfile.mkdtemp(prefix="mopd-process-")
        self._process = start(_main, (list(args), self._outputs, None if cwd is None else str(cwd)), env=env)
        self.pid = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._process.exitcode is not None:
            self._finish()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code (negative: the signal that ended it).

        Raises:
            subprocess.TimeoutExpired: still running after `timeout` seconds.
        """
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(9)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Waits for the end and returns (stdout, stderr)."""
        self.wait(timeout)
        return self.stdout, self.stderr

    def _finish(self) -> None:
        end_groups([self._process], 0.0)  # what it started and left behind
        self.returncode = self._process.exitcode
        outputs = Path(self._outputs)
        self.stdout, self.stderr = (
            (outputs / n).read_text() if (outputs / n).exists() else "" for n in ("stdout", "stderr")
        )
        shutil.rmtree(outputs, ignore_errors=True)


def run_mopd_process(
    args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 300.0
) -> subprocess.CompletedProcess[str]:
    """`mopd ARGS` to its end, as `subprocess.run([...], capture_output=True, text=True)` gives it.

    Raises:
        subprocess.TimeoutExpired: it ran past `timeout` seconds (and was killed).
    """
    job = MopdProcess(args, env=env, cwd=cwd)
    try:
        stdout, stderr = job.communicate(timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()
        raise
    return subprocess.CompletedProcess(job.args, job.wait(), stdout, stderr)

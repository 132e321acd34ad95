"""The object-storage docs' local S3 server, run as written: the two commands that start moto's server
and create the bucket, the environment that points mopd at it, then precompute into the bucket and train
from it (a small world's config in place of the quickstart's)."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.train.world import World, world_config

DOCS = Path(__file__).parents[2] / "docs" / "store-format.md"
MARKER = "**A local S3 server to try it on.**"


def documented_commands() -> list[str]:
    """The command lines of the bash blocks of the docs' local-server paragraph, as written."""
    section = DOCS.read_text().split(MARKER)[1].split("\n**")[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line.split(" #")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_for(port: int, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert server.poll() is None, "moto_server exited"
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"moto_server did not listen on {port} within 60 s")


def test_the_documented_local_server_takes_a_store(world: World, tmp_path: Path) -> None:
    start, create, export, precompute, train = documented_commands()
    port = str(_free_port())
    bindir = Path(sys.executable).parent  # the environment's scripts: moto_server is one
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    assert start.endswith("&")
    server = subprocess.Popen(
        shlex.split(start.removesuffix("&").replace("5000", port)),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(int(port), server)
        subprocess.run(shlex.split(create.replace("5000", port)), env=env, check=True, capture_output=True)
        words = shlex.split(export.replace("5000", port))
        assert words[0] == "export"
        env |= dict(word.split("=", 1) for word in words[1:])
        world_config(world, tmp_path, steps=1, optim={"warmup_steps": 0})
        for command in (precompute, train):
            words = shlex.split(command.replace("quickstart.yaml", str(tmp_path / "config.yaml")))
            assert words[0] == "mopd" and "s3://teachers/quickstart.zarr" in words
            done = subprocess.run(words, env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr
        assert "trained steps 1..1" in done.stderr
    finally:
        server.terminate()
        server.wait(timeout=30)

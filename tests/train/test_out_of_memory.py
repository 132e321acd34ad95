"""An allocation failure in training is one line naming the settings that bound memory (issue 32), and
`mopd train` prints its estimate of a rank's memory before step 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from mopd.train.report.memory import ACTIVATION_VALUES_PER_LAYER, estimate_peak
from mopd.train.trainer import Trainer
from tests.train.world import World, world_config

# Runs `mopd train CONFIG` with the process's address space capped, when step 1 starts, a few MiB
# above what it has mapped: the step's first large allocations fail as they would on a machine whose
# memory the run outgrew (`ulimit -v`), in torch's allocator, numpy or Python. One OpenMP thread: a
# thread pool started under the cap could not map its stacks, a failure of its own.
CAPPED_TRAIN = """
import resource, sys
from pathlib import Path
from mopd.cli.main import main
from mopd.train.trainer import Trainer

original = Trainer.train_step

def capped(self, step, batch):
    status = Path("/proc/self/status").read_text().splitlines()
    mapped = int(next(line for line in status if line.startswith("VmSize:")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (4 << 20), resource.RLIM_INFINITY))
    return original(self, step, batch)

Trainer.train_step = capped
sys.argv = ["mopd", "train", sys.argv[1]]
main()
"""


def test_an_allocation_failure_is_one_line_naming_the_memory_settings(world: World, tmp_path: Path) -> None:
    world_config(world, tmp_path, steps=2, batch={"micro_batch_tokens": 8192, "global_batch_tokens": 8192})
    run = subprocess.run(
        [sys.executable, "-c", CAPPED_TRAIN, str(tmp_path / "config.yaml")],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 1, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert "Traceback" not in run.stderr, run.stderr
    assert last.startswith("error: step 1: out of memory on rank 0 (cpu): "), last
    for setting in (
        "train.batch.micro_batch_tokens 8192",
        "train.divergence.chunk_size 64",
        "train.lm_head_lifecycle offload",
        "train.activation_checkpointing false",
    ):
        assert setting in last, setting


def test_the_memory_estimate_comes_before_step_1_and_adds_up(world: World, tmp_path: Path) -> None:
    """16 bytes a fp32 parameter (weights, gradients, two AdamW moments), the teacher heads held, 17
    hidden-size values per token and layer of activations (one per layer, plus one layer, when they are
    recomputed), three fp32 [chunk, vocabulary] kernel buffers."""
    lines: list[str] = []
    config = world_config(world, tmp_path, steps=1, batch={"micro_batch_tokens": 512})
    trainer = Trainer(config, log=lines.append)
    parameters = sum(p.numel() for p in trainer.student.parameters())
    hidden, layers = trainer.student.decoder_shape
    options = dict(
        hidden_size=hidden,
        layers=layers,
        vocab_rows=trainer.objective.local_rows,
        chunk_size=64,
        heads_bytes=trainer.heads.held_bytes,
    )
    estimate = estimate_peak(trainer.student.parameters(), tc=trainer.tc, **options)
    assert estimate.parts == {
        "weights": 4 * parameters,
        "gradients": 4 * parameters,
        "AdamW moments": 8 * parameters,
        "teacher heads": trainer.heads.held_bytes,
        "activations": 512 * hidden * layers * ACTIVATION_VALUES_PER_LAYER * 4,
        "kernel": 3 * 64 * trainer.objective.local_rows * 4,
    }
    recomputed = trainer.tc.model_copy(update={"activation_checkpointing": True})
    again = estimate_peak(trainer.student.parameters(), tc=recomputed, **options)
    assert again.parts["activations"] == 512 * hidden * (layers + ACTIVATION_VALUES_PER_LAYER) * 4
    trainer.close()
    (printed,) = [i for i, line in enumerate(lines) if line.startswith("memory estimate per rank on cpu: ")]
    assert lines[printed] == estimate.line(torch.device("cpu"))

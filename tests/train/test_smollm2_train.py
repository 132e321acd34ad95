"""Self-distillation on the real SmolLM2-135M (tied embeddings, vocabulary 49152): step 1 is at KL ≈ 0."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mopd.config.mopd_config import load_config
from mopd.precompute.packaged_models import smollm2_checkpoint
from mopd.precompute.runner import run_precompute
from mopd.store import open_store
from mopd.train.trainer import run_training
from tests.precompute.teachers import write_jsonl
from tests.precompute.test_smollm2 import TEXTS
from tests.tolerance import assert_close, value_atol


@pytest.mark.slow
def test_smollm2_distilled_from_itself_starts_at_zero(tmp_path: Path) -> None:
    checkpoint = smollm2_checkpoint()
    data = write_jsonl(tmp_path / "d.jsonl", [{"agent": "smol", "text": t} for t in TEXTS])
    raw = {
        "teachers": {"smol": str(checkpoint)},
        "data": {"path": str(data)},
        "store": {"path": "store.zarr", "dtype": "float32"},
        "precompute": {"batch_tokens": 512, "dtype": "float32"},
        "train": {
            "student": str(checkpoint),
            "steps": 1,
            "batch": {"micro_batch_tokens": 512, "global_batch_tokens": 512},
            "divergence": {"chunk_size": 128},
        },
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    config = load_config(tmp_path / "config.yaml")
    run_precompute(config, show_progress=False, log=lambda _: None)
    record = run_training(config, output=tmp_path / "run", log=lambda _line: None).records[0]
    assert record["trained_tokens"] > 50
    # KL ≥ 0 in exact arithmetic; each token's fp32 value rounds within value_atol of it.
    store = open_store(tmp_path / "store.zarr")
    gap = max(float((z.amax(1) - z.amin(1)).max()) for z in (store.teacher_logits(i) for i in range(2)))
    bound = value_atol(store.teacher(0).vocab_size, gap)
    assert_close(
        [record["divergence_min"], record["divergence_max"]], [0.0, 0.0], atol=bound, what="min, max"
    )

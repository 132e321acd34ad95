"""`store.encoding: int8-rotated`: a store of 8-bit codes that decodes to the exact store within the error
model, the same bytes however many jobs write it (one encoding per teacher, whoever fits it first), and
never mixed with another encoding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from mopd.base.errors import ManifestError, StoreIntegrityError
from mopd.cli.main import cli
from mopd.config.mopd_config import load_config
from mopd.precompute.outputs import StoreOutput
from mopd.precompute.runner import run_precompute
from mopd.store import open_store
from mopd.store.codec.int8_rotated import Calibration, expected_kl, kl_bound, logit_divergence
from mopd.store.format.layout import CODES, MEAN
from mopd.store.format.loading import load_plan
from mopd.store.format.manifest import CALIBRATION_FILE, INT8_ROTATED, MANIFEST_FILE, PLAN_FILE
from mopd.store.format.transform import LogitTransform
from mopd.store.summary import summarise_store
from mopd.store.verify import verify_store
from tests.fault_trials import store_contents
from tests.precompute.conftest import write_config
from tests.precompute.teachers import mixed_records, write_jsonl

QUIET = {"show_progress": False, "log": lambda *_: None}


@pytest.fixture
def configs(tmp_path: Path, tiny_teachers: dict[str, Path]) -> dict[str, Path]:
    """One dataset over three teachers (Llama 64, Qwen2 96, Gemma2 64 with a softcap), 3 rows a task:
    an fp32 exact store's config and an int8-rotated one's."""
    teachers = {
        "math": tiny_teachers["llama"],
        "code": tiny_teachers["qwen2"],
        "chat": tiny_teachers["gemma2"],
    }
    records = [{**r, "agent": list(teachers)[i % 3]} for i, r in enumerate(mixed_records(24))]
    data = write_jsonl(tmp_path / "rows.jsonl", records)
    out = {}
    for encoding in ("exact", INT8_ROTATED):
        folder = tmp_path / encoding
        folder.mkdir()
        out[encoding] = write_config(folder, teachers, data=data, store=str(folder / "store.zarr"))
        raw = yaml.safe_load(out[encoding].read_text())
        raw["store"]["encoding"] = encoding
        out[encoding].write_text(yaml.safe_dump(raw))
    return out


def test_an_int8_store_decodes_to_the_exact_store_within_the_error_bound(configs: dict[str, Path]) -> None:
    exact = run_precompute(load_config(configs["exact"]), **QUIET).manifest
    coded = run_precompute(load_config(configs[INT8_ROTATED]), **QUIET).manifest
    assert exact is not None and coded is not None
    assert coded.required_features == [INT8_ROTATED] and exact.required_features == []
    assert [a.teacher for a in coded.encodings] == [0, 1, 2]
    # An exact store's records are those of a mopd before encodings: no new key in any of them.
    exact_root = Path(load_config(configs["exact"]).store.path)
    for record in (MANIFEST_FILE, PLAN_FILE):
        assert "encoding" not in (exact_root / record).read_text()

    a, b = open_store(exact_root), open_store(load_config(configs[INT8_ROTATED]).store.path)
    rows = np.arange(a.num_rows)
    checked, largest = 0, 0.0
    measured: list[torch.Tensor] = []
    model: list[torch.Tensor] = []
    for row, x, y in zip(rows, a.hiddens(rows), b.hiddens(rows), strict=True):
        teacher = a.row(int(row)).teacher_index
        entry = a.teacher(teacher)
        head = a.lm_head(teacher)
        assert y.dtype == torch.float32 and y.shape == x.shape
        encoding, _ = b.encoding(teacher)  # type: ignore[misc]
        _, scales = encoding.encode(x)
        transform = LogitTransform(entry.logit_scale, entry.final_logit_softcap)
        kl, _ = logit_divergence(x @ head.T, (x - y) @ head.T, transform)
        # Hoeffding's bound holds through a softcap, which is 1-Lipschitz: the logits' range only shrinks.
        # The decoded states are the codes' up to the rotation's fp32 rounding, ~1e-6 of the int8 step:
        # 1% of the bound covers it.
        assert bool((kl <= 1.01 * kl_bound(head, scales)).all()), (row, float(kl.max()))
        checked += len(kl)
        if transform.is_identity:
            measured.append(kl)
            model.append(expected_kl(torch.softmax((x @ head.T).double(), dim=-1), head, scales))
            largest = max(largest, float(((x - y) @ head.T).abs().max()))
    assert checked == coded.dataset.num_tokens
    # And on average the error model's (s²/24) tr Cov_p(W): within 4 standard errors plus the third-order
    # term, at most the largest logit error relative (as in `test_encoding.py`).
    kls, models = torch.cat(measured), torch.cat(model)
    standard_error = float((kls - models).std()) / len(kls) ** 0.5
    third_order = largest * float(models.mean())
    assert abs(float(kls.mean()) - float(models.mean())) <= 4 * standard_error + third_order
    # Codes take a byte a value and one fp32 scale a token, against 4 bytes a value exactly.
    for teacher in range(3):
        shards = [s for s in coded.shards if s.teacher == teacher]
        exact_shards = [s for s in exact.shards if s.teacher == teacher]
        assert sum(s.bytes for s in shards) < 0.5 * sum(s.bytes for s in exact_shards)
    summary = summarise_store(b.root)
    assert summary.encoding == INT8_ROTATED and all(t.calibration is not None for t in summary.teachers)
    first = summary.teachers[0].calibration
    assert first is not None and 0 < first.kl_mean <= first.kl_p99 <= first.kl_max
    assert first.measured_tokens == min(2048, first.calibration_tokens) > 0
    assert verify_store(b.root, full=True) == ([], [])


def test_three_jobs_give_the_one_job_store(configs: dict[str, Path], tmp_path: Path) -> None:
    config = load_config(configs[INT8_ROTATED])
    run_precompute(config, store_path=tmp_path / "one.zarr", **QUIET)
    for index in (2, 0, 1):
        run_precompute(config, store_path=tmp_path / "three.zarr", num_tasks=3, task_index=index, **QUIET)
    assert (tmp_path / "three.zarr" / MANIFEST_FILE).exists()
    assert store_contents(tmp_path / "three.zarr") == store_contents(tmp_path / "one.zarr")


def test_a_job_that_loses_the_encoding_race_encodes_with_the_winners(
    configs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two jobs fit a teacher's encoding at once (their machines' teachers differ in the last bits): the
    second to publish keeps the first one's, and so do its shards."""
    config = load_config(configs[INT8_ROTATED])
    store = tmp_path / "raced.zarr"
    fit = Calibration.fit

    def shifted_fit(self: Calibration, *args: object, **kwargs: object) -> object:
        encoding, info = fit(self, *args, **kwargs)  # type: ignore[arg-type]
        encoding.mean.add_(0.5)  # another machine's fit
        return encoding, info

    monkeypatch.setattr(Calibration, "fit", shifted_fit)
    run_precompute(config, store_path=store, num_tasks=2, task_index=0, **QUIET)
    monkeypatch.setattr(Calibration, "fit", fit)
    # The second job does not see the first one's encodings as done, so it fits and publishes its own.
    done = StoreOutput.done
    monkeypatch.setattr(
        StoreOutput, "done", lambda self: {t for t in done(self) if not t.endswith("_encoding")}
    )
    result = run_precompute(config, store_path=store, num_tasks=2, task_index=1, **QUIET)
    assert any(t.endswith("_encoding") for t in result.tasks_computed)
    assert result.manifest is not None
    coded, exact = open_store(store), open_store(run_precompute(load_config(configs["exact"]), **QUIET).store)
    winner = coded.encoding(0)
    assert winner is not None and float(winner[0].mean.sum()) != 0
    rows = np.arange(coded.num_rows)
    for x, y in zip(exact.hiddens(rows), coded.hiddens(rows), strict=True):
        # Shards encoded with a mean 0.5 off in every channel would decode 0.5 off.
        assert float((x - y).abs().max()) < 0.25


@pytest.mark.parametrize("first", ["exact", INT8_ROTATED])
def test_a_store_refuses_a_job_of_another_encoding(configs: dict[str, Path], first: str) -> None:
    second = INT8_ROTATED if first == "exact" else "exact"
    store = load_config(configs[first]).store.path
    run_precompute(load_config(configs[first]), num_tasks=2, task_index=0, **QUIET)
    out = CliRunner().invoke(cli, ["precompute", str(configs[second]), "--store", store])
    assert out.exit_code == 1, out.output
    assert f"store.encoding {first} in the store, {second} in this job's config" in out.stderr
    assert f"set store.encoding: {first}" in out.stderr
    with pytest.raises(ManifestError):
        run_precompute(load_config(configs[second]), store_path=store, **QUIET)
    assert load_plan(store).storage.encoding == first


def test_verify_names_a_config_of_another_encoding(configs: dict[str, Path]) -> None:
    result = run_precompute(load_config(configs[INT8_ROTATED]), **QUIET)
    problems, _ = verify_store(result.store, encoding="exact")
    assert problems == [
        "store.encoding: 'int8-rotated' in the store, 'exact' in the config (a precompute with this config "
        "would refuse the store; training reads it as it is stored)"
    ]
    out = CliRunner().invoke(cli, ["verify-manifest", result.store, "--config", str(configs["exact"])])
    assert out.exit_code == 1 and "store.encoding" in out.output


@pytest.mark.parametrize("damage", ["calibration", "mean", "codes"])
def test_a_changed_encoding_or_code_is_refused(configs: dict[str, Path], tmp_path: Path, damage: str) -> None:
    result = run_precompute(load_config(configs[INT8_ROTATED]), **QUIET)
    root = Path(result.store)
    manifest = open_store(root).manifest
    encoding = next(t for t in manifest.encodings if t.teacher == 0).path
    target = {
        "calibration": root / encoding / CALIBRATION_FILE,
        "mean": root / encoding / MEAN / "c" / "0",
        "codes": root / manifest.shards[0].path / CODES / "c" / "0" / "0",
    }[damage]
    if damage == "calibration":  # a plausible edit: a smaller KL than measured
        record = json.loads(target.read_text())
        record["kl_mean"] /= 10
        target.write_text(json.dumps(record, sort_keys=True, indent=1) + "\n")
    else:
        data = bytearray(target.read_bytes())
        data[len(data) // 3] ^= 0x10
        target.write_bytes(bytes(data))
    store = open_store(root)
    with pytest.raises(StoreIntegrityError):
        store.hiddens(np.flatnonzero(store.teacher_indices == manifest.shards[0].teacher))
    problems, _ = verify_store(root, full=True)
    assert problems and all(encoding in p or manifest.shards[0].path in p for p in problems)
    shutil.rmtree(root)

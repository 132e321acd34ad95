"""Precompute with a teacher of another tokenizer (DESIGN §13): its rows in its own tokens, its hidden
states at its own positions, the alignment of each row's two tokenisations, the manifest's feature and
tokenizer fingerprints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from mopd.config.mopd_config import load_config
from mopd.precompute.runner import run_precompute
from mopd.store import TeacherStore, open_store
from mopd.store.format.manifest import CROSS_TOKENIZER
from mopd.store.verify import verify_store
from mopd.tokens.pieces import token_table, tokenizer_fingerprint
from mopd.tokens.projection import first_token_projection
from tests.precompute.teachers import (
    mixed_records,
    other_vocabulary_teacher,
    write_jsonl,
)
from tests.tolerance import assert_close, network_rtol


def test_the_manifest_marks_the_feature_and_binds_both_tokenizers(cross_store: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    store: TeacherStore = cross_store["store"]
    manifest = store.manifest
    assert manifest.required_features == [CROSS_TOKENIZER]
    own = {t.checkpoint: t.tokenizer for t in manifest.teachers}
    assert own[str(cross_store["same"])] is None
    other = own[str(cross_store["other"])]
    assert other is not None and other.vocab_size == 380
    assert other.fingerprint == tokenizer_fingerprint(AutoTokenizer.from_pretrained(cross_store["other"]))
    assert manifest.tokenizer.fingerprint == tokenizer_fingerprint(
        AutoTokenizer.from_pretrained(cross_store["same"])
    )
    problems, _ = verify_store(store.root, full=True)
    assert problems == []


def test_precompute_and_inspect_give_the_aligned_share(cross_store: dict[str, Any]) -> None:
    """One line for the teacher of another tokenizer, with the shares the stored alignment gives row by
    row, in precompute's log and in `mopd inspect` (its tokenizer named; `--json` the same figures)."""
    from click.testing import CliRunner

    from mopd.cli.main import cli

    store: TeacherStore = cross_store["store"]
    other = next(t for t in store.teachers if t.tokenizer is not None)
    trained = aligned = either = 0
    for i in (i for i in range(store.num_rows) if store.row(i).teacher_index == other.index):
        mask = store.row(i).loss_mask.numpy().astype(bool)
        stored = store.alignment(i)
        trained += int(mask.sum())
        aligned += int((stored.aligned[mask] >= 0).sum())
        either += int(((stored.aligned >= 0) | (stored.student_span >= 0))[mask].sum())
    (line,) = [line for line in cross_store["log"] if "another tokenizer" in line]
    assert line == (
        f"teacher chat (another tokenizer): {aligned / trained:.1%} of its trained positions aligned "
        f"with one of its own, {either / trained:.1%} aligned or inside a span of the same text"
    )
    shown = CliRunner().invoke(cli, ["inspect", str(store.root)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    (line,) = [line for line in shown.output.splitlines() if "another tokenizer" in line]
    assert line == (
        f"{other.index}: another tokenizer ({other.tokenizer.name}): {aligned / trained:.1%} of its trained "
        f"positions aligned with one of its own, {either / trained:.1%} aligned or inside a span"
    )
    summary = json.loads(CliRunner().invoke(cli, ["inspect", str(store.root), "--json"]).output)
    (entry,) = [t for t in summary["teachers"] if t["tokenizer"] is not None]
    assert (entry["aligned_share"], entry["signal_share"]) == (aligned / trained, either / trained)


def test_the_store_holds_the_teachers_projection(cross_store: dict[str, Any]) -> None:
    """The projection of the teacher's vocabulary onto the store's, as the two tokenizers give it:
    training needs neither tokenizer."""
    from transformers import AutoTokenizer

    store: TeacherStore = cross_store["store"]
    other = next(t for t in store.teachers if t.tokenizer is not None)
    student = AutoTokenizer.from_pretrained(cross_store["same"])
    want = first_token_projection(
        token_table(AutoTokenizer.from_pretrained(cross_store["other"])), student, token_table(student)
    )
    source, target, weight = store.projection(other.index)
    assert np.array_equal(source, want.source.numpy()) and np.array_equal(target, want.target.numpy())
    assert np.array_equal(weight, want.weight.numpy())
    assert [a.teacher for a in store.manifest.projections] == [other.index]
    with pytest.raises(ValueError, match="shares the store's tokenizer"):
        store.projection(next(t.index for t in store.teachers if t.tokenizer is None))


def test_rows_of_the_other_tokenizer_hold_its_tokens_states_and_alignment(
    cross_store: dict[str, Any],
) -> None:
    """Its rows are the chat template of its own tokenizer, its states its own forward over them (within
    the network's rounding of another batch), and the alignment the one `align_row` gives."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store: TeacherStore = cross_store["store"]
    other = next(t for t in store.teachers if t.tokenizer is not None)
    student_tok = AutoTokenizer.from_pretrained(cross_store["same"])
    teacher_tok = AutoTokenizer.from_pretrained(cross_store["other"])
    model = AutoModelForCausalLM.from_pretrained(cross_store["other"], dtype=torch.float32)
    rows = [i for i in range(store.num_rows) if store.row(i).teacher_index == other.index]
    assert rows
    aligned = trained = 0
    for i in rows:
        row, stored = store.row(i), store.alignment(i)
        assert np.array_equal(store.aligned(i), stored.aligned)  # what training reads of it
        text = student_tok.decode(row.input_ids)  # the chat row as the store's tokenizer rendered it
        own_text = teacher_tok.decode(stored.token_ids)  # both render ChatML; the teacher's is cut sooner
        assert not np.array_equal(stored.token_ids, row.input_ids.numpy())  # another tokenisation
        assert text.startswith(own_text) or own_text.startswith(text)
        hidden = store.hidden(i)
        assert hidden.shape == (stored.token_ids.shape[0], other.hidden_size)
        with torch.no_grad():
            want = model(torch.as_tensor(stored.token_ids)[None], output_hidden_states=True).hidden_states[
                -1
            ][0]
        assert_close(hidden, want, rtol=network_rtol(cross_store["other"]), norm=True, what=f"row {i} states")
        mask = row.loss_mask.numpy().astype(bool)
        teacher_mask = (stored.teacher_span >= 0) | np.isin(
            np.arange(len(stored.token_ids)), stored.aligned[mask]
        )
        assert stored.aligned.shape == tuple(row.input_ids.shape) and stored.student_span.shape == tuple(
            row.input_ids.shape
        )
        assert (stored.aligned[~mask] == -1).all() and (stored.student_span[~mask] == -1).all()
        assert teacher_mask.any()
        aligned += int((stored.aligned[mask] >= 0).sum())
        trained += int(mask.sum())
        # Each aligned pair has read the same text, and predicts what starts right after it.
        for t in np.flatnonzero(stored.aligned >= 0):
            u = int(stored.aligned[t])
            assert student_tok.decode(row.input_ids[: t + 1]) == teacher_tok.decode(stored.token_ids[: u + 1])
    assert 0.3 < aligned / trained < 1.0  # two BPEs of one corpus: most boundaries shared, not all


def test_each_span_holds_the_same_text_on_both_sides(cross_store: dict[str, Any]) -> None:
    """The tokens the positions of span k predict spell one text in either tokenizer, and the spans of
    a row cover every trained position the teacher's row reaches."""
    from transformers import AutoTokenizer

    store: TeacherStore = cross_store["store"]
    student_tok = AutoTokenizer.from_pretrained(cross_store["same"])
    teacher_tok = AutoTokenizer.from_pretrained(cross_store["other"])
    other = next(t for t in store.teachers if t.tokenizer is not None)
    spans = covered = 0
    for i in (i for i in range(store.num_rows) if store.row(i).teacher_index == other.index):
        row, stored = store.row(i), store.alignment(i)
        ids = row.input_ids.numpy()
        for k in range(int(stored.student_span.max()) + 1):
            student = ids[np.flatnonzero(stored.student_span == k) + 1]
            teacher = stored.token_ids[np.flatnonzero(stored.teacher_span == k) + 1]
            assert student.size and teacher.size
            assert student_tok.decode(student) == teacher_tok.decode(teacher)
            spans += 1
        covered += int((stored.student_span >= 0).sum())
    assert spans > 10 and covered > 0


def test_a_reader_without_the_feature_refuses_the_store(
    cross_store: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mopd that does not know the feature refuses the store at open, naming it."""
    from mopd.base.errors import ManifestError
    from mopd.store.format import manifest as manifest_module

    store: TeacherStore = cross_store["store"]
    monkeypatch.setattr(manifest_module, "KNOWN_FEATURES", frozenset({manifest_module.INT8_ROTATED}))
    with pytest.raises(ManifestError, match="cross-tokenizer"):
        open_store(store.root)


def test_verify_manifest_finds_a_changed_alignment(cross_store: dict[str, Any], tmp_path: Path) -> None:

    from mopd.store.format.layout import ALIGNED

    copy = tmp_path / "store.zarr"
    shutil.copytree(cross_store["store"].root, copy)
    store = open_store(copy)
    shard = next(s for s in store.manifest.shards if store.teacher(s.teacher).tokenizer is not None)
    chunk = next(
        p for p in sorted((copy / shard.path / ALIGNED).rglob("*")) if p.is_file() and p.name != "zarr.json"
    )
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0x01
    chunk.write_bytes(bytes(data))
    problems, _ = verify_store(copy, full=True)
    assert any(ALIGNED in p for p in problems), problems


def test_rows_of_ids_and_their_text_give_the_teacher_the_text(
    tmp_path: Path, tiny_teachers: dict[str, Path]
) -> None:
    """`mopd rollout`'s rows: the student's sampled ids with their text beside them. The student trains on
    the ids; a teacher of another tokenizer reads the text through its own chat template. Ids alone are
    refused for it, in one line."""
    from transformers import AutoTokenizer

    from mopd.base.errors import ConfigError

    student = tiny_teachers["llama"]
    other = other_vocabulary_teacher(tmp_path)
    student_tok, teacher_tok = AutoTokenizer.from_pretrained(student), AutoTokenizer.from_pretrained(other)
    records = []
    for r in mixed_records(3):
        ids = student_tok.apply_chat_template(r["messages"], tokenize=True, return_dict=False)
        records.append({**r, "agent": "chat", "input_ids": list(ids)})
    for name, rows in (
        ("with-text", records),
        ("ids-only", [{k: v for k, v in r.items() if k != "messages"} for r in records]),
    ):
        folder = tmp_path / name
        folder.mkdir()
        raw = {
            "tokenizer": str(student),
            "teachers": {"chat": str(other)},
            "data": {"path": str(write_jsonl(folder / "rows.jsonl", rows)), "max_length": 96},
            "store": {"path": str(folder / "store.zarr"), "dtype": "float32"},
            "precompute": {"rows_per_task": 4, "batch_tokens": 256, "dtype": "float32"},
        }
        (folder / "config.yaml").write_text(yaml.safe_dump(raw))
        if name == "ids-only":
            with pytest.raises(
                ConfigError, match="gives input_ids alone: a teacher of another tokenizer reads"
            ):
                run_precompute(load_config(folder / "config.yaml"), show_progress=False, log=lambda _: None)
            continue
        run_precompute(load_config(folder / "config.yaml"), show_progress=False, log=lambda _: None)
        store = open_store(folder / "store.zarr")
        for i, record in enumerate(records):
            assert store.row(i).input_ids.tolist() == record["input_ids"]  # the student's own ids
            want = teacher_tok.apply_chat_template(record["messages"], tokenize=True, return_dict=False)
            stored = store.alignment(i)
            assert stored.token_ids.tolist() == list(want)[: len(stored.token_ids)]
            assert (stored.aligned >= 0).sum() > 10

"""Precompute with a teacher of another tokenizer (DESIGN §13): its rows in its own tokens, its hidden
states at its own positions, the alignment of each row's two tokenisations, the manifest's feature and
tokenizer fingerprints."""

from __future__ import annotations

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
from tests.precompute.conftest import routed_config
from tests.precompute.teachers import CORPUS, make_tokenizer, save_teacher
from tests.tolerance import assert_close, network_rtol


@pytest.fixture(scope="module")
def cross_store(tmp_path_factory: pytest.TempPathFactory, tiny_teachers: dict[str, Path]) -> dict[str, Any]:
    """Chat rows for a teacher of the store's tokenizer (`math`) and one of another byte-level BPE (`chat`:
    380 tokens trained on the corpus without its arithmetic, so that it merges otherwise), in turn."""
    root = tmp_path_factory.mktemp("cross")
    other = save_teacher(
        root / "other-vocab",
        "llama",
        hidden_size=64,
        seed=7,
        tokenizer=make_tokenizer(vocab_size=380, corpus=CORPUS[150:]),
        head_dim=32,
    )
    teachers = {"math": tiny_teachers["llama"], "chat": other}
    config = routed_config(root, teachers, rows=10)
    raw = yaml.safe_load(config.read_text())
    raw["tokenizer"] = str(tiny_teachers["llama"])
    config.write_text(yaml.safe_dump(raw))
    result = run_precompute(load_config(config), show_progress=False, log=lambda _: None)
    assert result.manifest is not None
    return {
        "store": open_store(raw["store"]["path"]),
        "other": other,
        "same": tiny_teachers["llama"],
        "config": config,
    }


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


def test_a_reader_without_the_feature_and_training_refuse_the_store(
    cross_store: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mopd that does not know the feature refuses the store at open, naming it; this mopd's training
    refuses it in one line until it distils such teachers (the store's alignment is for that)."""
    from mopd.base.errors import ConfigError, ManifestError
    from mopd.store.format import manifest as manifest_module
    from mopd.train.vocabulary import distilled_vocabulary

    store: TeacherStore = cross_store["store"]
    with pytest.raises(ConfigError, match=r"have another tokenizer than .* does not yet train from them"):
        distilled_vocabulary(store.manifest, student_rows=400)
    monkeypatch.setattr(manifest_module, "KNOWN_FEATURES", frozenset({manifest_module.INT8_ROTATED}))
    with pytest.raises(ManifestError, match="cross-tokenizer"):
        open_store(store.root)


def test_verify_manifest_finds_a_changed_alignment(cross_store: dict[str, Any], tmp_path: Path) -> None:
    import shutil

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

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
from tests.precompute.conftest import routed_config
from tests.precompute.teachers import (
    mixed_records,
    other_vocabulary_teacher,
    write_jsonl,
)
from tests.tolerance import assert_close, network_rtol, trajectory_rtol


@pytest.fixture(scope="module")
def cross_store(tmp_path_factory: pytest.TempPathFactory, tiny_teachers: dict[str, Path]) -> dict[str, Any]:
    """Chat rows for a teacher of the store's tokenizer (`math`) and one of another byte-level BPE (`chat`:
    380 tokens trained on the corpus without its arithmetic, so that it merges otherwise), in turn."""
    root = tmp_path_factory.mktemp("cross")
    other = other_vocabulary_teacher(root)
    teachers = {"math": tiny_teachers["llama"], "chat": other}
    config = routed_config(root, teachers, rows=10)
    raw = yaml.safe_load(config.read_text())
    raw["tokenizer"] = str(tiny_teachers["llama"])
    config.write_text(yaml.safe_dump(raw))
    lines: list[str] = []
    result = run_precompute(load_config(config), show_progress=False, log=lines.append)
    assert result.manifest is not None
    store = open_store(raw["store"]["path"])
    return {
        "store": store,
        "other": other,
        "same": tiny_teachers["llama"],
        "student": tiny_teachers["llama_small"],  # of the store's tokenizer, and no teacher
        "config": config,
        "log": lines,
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


def test_precompute_logs_the_aligned_share(cross_store: dict[str, Any]) -> None:
    """One line for the teacher of another tokenizer, with the shares the stored alignment gives."""
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


def train_config(cross_store: dict[str, Any], folder: Path, student: Path, **train: Any) -> Path:
    """The cross store's config with a train section: `student`, 3 steps over every row."""
    raw = yaml.safe_load(cross_store["config"].read_text())
    raw["train"] = {
        "student": str(student),
        "steps": 3,
        "optim": {"lr": 5.0e-3, "warmup_steps": 1},
        "batch": {"micro_batch_tokens": 256, "global_batch_tokens": 512},
        "divergence": {"chunk_size": 32},
        "output_dir": str(folder / "run"),
        **train,
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("lifecycle", ["none", "offload"])
def test_training_distils_both_teachers(cross_store: dict[str, Any], tmp_path: Path, lifecycle: str) -> None:
    """A student of the store's tokenizer (the `math` teacher's own checkpoint) trains from the teacher
    of its tokenizer and the one of another (resident heads, and one at a time): each teacher's
    divergence is reported and finite, and the other's aligned share in the records and step lines."""
    from mopd.train.report.metrics import METRICS_FILE, read_metrics
    from mopd.train.trainer import run_training

    config = train_config(cross_store, tmp_path, cross_store["same"], lm_head_lifecycle=lifecycle)
    lines: list[str] = []
    result = run_training(load_config(config), log=lines.append)
    records = [r for r in read_metrics(tmp_path / "run" / METRICS_FILE) if r.get("split", "train") == "train"]
    assert [r["step"] for r in records] == [1, 2, 3] and result is not None
    store: TeacherStore = cross_store["store"]
    by_teacher = records[0]["divergence_by_teacher"]
    assert set(by_teacher) == {str(t.index) for t in store.teachers}
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in records)
    same = next(t.index for t in store.teachers if t.tokenizer is None)
    assert by_teacher[str(same)] < 1e-4  # the student is that teacher: its divergence starts at 0
    other = next(t for t in store.teachers if t.tokenizer is not None)
    shares = []
    for record in records:  # reported for the teacher of another tokenizer only
        assert set(record["aligned_share_by_teacher"]) == {str(other.index)}
        shares.append(record["aligned_share_by_teacher"][str(other.index)])
    assert (
        all(0.3 < share <= 1.0 for share in shares) and min(shares) < 1.0
    )  # a step's rows, some all aligned
    assert any(" aligned [chat=" in line for line in lines if line.startswith("step 1/"))


def test_training_refuses_a_student_whose_tokenizer_is_not_the_aligned_one(
    cross_store: dict[str, Any], tmp_path: Path
) -> None:
    """Same vocabulary, another chat template: the alignment no longer holds, and training says so."""
    import shutil

    from mopd.base.errors import ConfigError
    from mopd.train.trainer import run_training

    student = tmp_path / "student"
    shutil.copytree(cross_store["same"], student)
    settings = json.loads((student / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (student / "tokenizer_config.json").write_text(json.dumps(settings))
    (student / "chat_template.jinja").unlink(missing_ok=True)
    config = train_config(cross_store, tmp_path, student)
    with pytest.raises(
        ConfigError, match="is not the one the store's teachers of other tokenizers were aligned to"
    ):
        run_training(load_config(config), log=lambda _: None)


def permuted_teacher(source: Path, target: Path, seed: int) -> Path:
    """`source` with its token ids permuted: tokenizer ids, embedding rows and output rows alike, so it
    computes the same function of text (and the same hidden states) under other ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    spec = json.loads((source / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    perm = torch.randperm(len(vocab), generator=torch.Generator().manual_seed(seed))  # old id -> new id
    spec["model"]["vocab"] = {token: int(perm[i]) for token, i in vocab.items()}
    for added in spec["added_tokens"]:
        added["id"] = int(perm[added["id"]])
    with torch.no_grad():
        for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
            moved = torch.empty_like(layer.weight)
            moved[perm] = layer.weight
            layer.weight.copy_(moved)
    model.save_pretrained(target)
    for name in (p.name for p in source.iterdir() if "token" in p.name or p.suffix == ".jinja"):
        shutil.copy(source / name, target / name)
    (target / "tokenizer.json").write_text(json.dumps(spec))
    return target


def test_a_permuted_teacher_trains_the_same_tokenizer_run(
    tmp_path: Path, tiny_teachers: dict[str, Path]
) -> None:
    """Exactness by construction: a teacher whose tokenizer is the student's with its ids permuted (its
    embedding and output rows moved to match) goes through precompute's second tokenisation, the
    alignment and the projection, and trains the losses of the same teacher under the student's own
    ids: every position aligned, and each step's loss and divergence within two fp32 trajectories'
    rounding of the same run (`trajectory_rtol`: 3 steps of a 2-block network)."""
    from mopd.train.report.metrics import METRICS_FILE, read_metrics
    from mopd.train.trainer import run_training

    teacher = tiny_teachers["llama"]
    permuted = permuted_teacher(teacher, tmp_path / "permuted-teacher", seed=5)
    records = [{**r, "agent": "chat"} for r in mixed_records(8)]
    data = write_jsonl(tmp_path / "chat.jsonl", records)
    runs = {}
    for name, chat_teacher in (("same", teacher), ("permuted", permuted)):
        folder = tmp_path / name
        folder.mkdir()
        raw = {
            "tokenizer": str(teacher),
            "teachers": {"chat": str(chat_teacher)},
            "data": {"path": str(data), "max_length": 96},
            "store": {"path": str(folder / "store.zarr"), "dtype": "float32"},
            "precompute": {"rows_per_task": 4, "batch_tokens": 256, "dtype": "float32"},
            "train": {
                "student": str(tiny_teachers["llama_small"]),
                "steps": 3,
                "optim": {"lr": 5.0e-3, "warmup_steps": 1},
                "batch": {"micro_batch_tokens": 256, "global_batch_tokens": 512},
                "divergence": {"chunk_size": 32},
                "output_dir": str(folder / "run"),
            },
        }
        (folder / "config.yaml").write_text(yaml.safe_dump(raw))
        config = load_config(folder / "config.yaml")
        run_precompute(config, show_progress=False, log=lambda _: None)
        run_training(config, log=lambda _: None)
        runs[name] = [
            r for r in read_metrics(folder / "run" / METRICS_FILE) if r.get("split", "train") == "train"
        ]
    store = open_store(tmp_path / "permuted" / "store.zarr")
    assert store.manifest.required_features == [CROSS_TOKENIZER]  # the permutation went through
    source, target, _ = store.projection(0)
    assert not np.array_equal(source, target)
    for i in range(store.num_rows):
        mask = store.row(i).loss_mask.numpy().astype(bool)
        assert (store.alignment(i).aligned[mask] >= 0).all()
    rtol = trajectory_rtol(3, 2, 128)
    for same, perm in zip(runs["same"], runs["permuted"], strict=True):
        assert_close(perm["loss"], same["loss"], rtol=rtol, what=f"step {same['step']} loss")
        assert_close(
            perm["divergence"], same["divergence"], rtol=rtol, what=f"step {same['step']} divergence"
        )


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


def test_a_projection_file_replaces_the_stores_and_a_resume_holds_to_it(
    cross_store: dict[str, Any], tmp_path: Path
) -> None:
    """`train.cross_tokenizer.projection`: the run trains with the file's projection, records its
    fingerprint, and a resume with another file is refused naming the setting; an alias the store has
    no teacher of another tokenizer under is refused before training."""
    from mopd.base.errors import CheckpointError, ConfigError
    from mopd.tokens.projection import Projection
    from mopd.train.checkpoint.run_record import PROJECTIONS
    from mopd.train.trainer import Trainer, run_training

    store: TeacherStore = cross_store["store"]
    other = next(t for t in store.teachers if t.tokenizer is not None)
    source, target, weight = (torch.from_numpy(a) for a in store.projection(other.index))
    sizes = dict(teacher_vocab=other.tokenizer.vocab_size, student_vocab=store.manifest.tokenizer.vocab_size)
    first, second = tmp_path / "first.safetensors", tmp_path / "second.safetensors"
    Projection(source, target, weight, **sizes).save(first)
    shifted = (target + 1) % sizes["student_vocab"]  # another valid projection
    Projection(source, shifted, weight, **sizes).save(second)
    checkpoint = {"every": 2, "keep": 2}
    config = train_config(
        cross_store,
        tmp_path,
        cross_store["same"],
        cross_tokenizer={"projection": {"chat": str(first)}},
        checkpoint=checkpoint,
        steps=2,
    )
    run_training(load_config(config), log=lambda _: None)
    with Trainer(load_config(config), log=lambda _: None) as trainer:
        assert trainer.session.projection_fingerprints == {
            other.index: Projection(source, target, weight, **sizes).fingerprint
        }
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("*/state.json")).read_text())
    assert state["run"][PROJECTIONS] == {
        str(other.index): Projection(source, target, weight, **sizes).fingerprint
    }
    again = train_config(
        cross_store,
        tmp_path,
        cross_store["same"],
        cross_tokenizer={"projection": {"chat": str(second)}},
        checkpoint=checkpoint,
        steps=3,
    )
    with pytest.raises(CheckpointError, match=f"{PROJECTIONS}: .* in the checkpoint, .* now"):
        run_training(load_config(again), log=lambda _: None)
    wrong = train_config(
        cross_store,
        tmp_path / "wrong",
        cross_store["same"],
        cross_tokenizer={"projection": {"math": str(first)}},
    )
    with pytest.raises(
        ConfigError, match=r"train\.cross_tokenizer\.projection\.math: the store has no teacher"
    ):
        run_training(load_config(wrong), log=lambda _: None)


@pytest.mark.distributed
def test_two_data_parallel_ranks_with_unequal_cross_tokenizer_work_match_one(
    cross_store: dict[str, Any], tmp_path: Path
) -> None:
    """`torchrun --nproc-per-node 2` on the mixed store: microbatches of 128 tokens deal the ranks
    unequal shares of each step — rows of the other tokenizer's teacher on one rank and not the other,
    more microbatches on one — yet every rank runs the same collectives, and the run equals one rank's
    within `assert_same_training` (the student: a 2-block llama, 96 wide), the trained-token counts and
    aligned shares exactly."""
    from mopd.train.data.order import epoch_steps, rank_microbatches
    from mopd.train.report.metrics import METRICS_FILE, read_metrics
    from mopd.train.trainer import run_training
    from tests.distributed.harness import run_torchrun
    from tests.tolerance import assert_same_training

    batch = {"micro_batch_tokens": 128, "global_batch_tokens": 512}
    store: TeacherStore = cross_store["store"]
    other = next(t.index for t in store.teachers if t.tokenizer is not None)
    shares = []  # per step: (rank 0's, rank 1's) microbatches and rows of the other tokenizer's teacher
    for rows in epoch_steps(store.lengths, seed=0, epoch=0, global_batch_tokens=512)[:3]:
        ranks = [
            rank_microbatches(rows, store.lengths, dp_rank=r, dp_size=2, micro_batch_tokens=128)
            for r in (0, 1)
        ]
        shares.append(
            tuple((len(m), sum(int((store.teacher_indices[b] == other).sum()) for b in m)) for m in ranks)
        )
    assert any(a != b for a, b in shares), shares  # the ranks' work differs in some step
    one = train_config(cross_store, tmp_path / "one", cross_store["student"], batch=batch, steps=3)
    run_training(load_config(one), log=lambda _: None)
    two = train_config(cross_store, tmp_path / "two", cross_store["student"], batch=batch, steps=3)
    run_torchrun(["train", str(two)], nproc=2)
    ones = [
        r for r in read_metrics(tmp_path / "one" / "run" / METRICS_FILE) if r.get("split", "train") == "train"
    ]
    twos = read_metrics(tmp_path / "two" / "run" / METRICS_FILE)
    assert [r["step"] for r in twos] == [1, 2, 3]
    for got, want in zip(twos, ones, strict=True):
        assert got["trained_tokens"] == want["trained_tokens"]
        assert got["aligned_share_by_teacher"] == want["aligned_share_by_teacher"]
    assert_same_training(twos, ones, layers=2, width=128)

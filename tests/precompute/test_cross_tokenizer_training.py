"""Training from a store with a teacher of another tokenizer (DESIGN §13): both teachers distilled and
reported, a student of another tokenizer refused, the permuted teacher's exactness, projection files,
the span log-likelihood match and data parallelism."""

from __future__ import annotations

import json
import re
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
from tests.precompute.conftest import train_config
from tests.precompute.teachers import mixed_records, write_jsonl
from tests.tolerance import assert_close, trajectory_rtol


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
    # Before step 1, the shares the store's records give, as precompute logged them.
    logged = next(line for line in cross_store["log"] if "another tokenizer" in line)
    assert f"{logged}; span loss weight 1" in lines
    # The span term (on by default) is reported beside the divergence, per trained token.
    assert all(np.isfinite(r["span"]) and r["span"] > 0 for r in records)
    assert any(" span " in line for line in lines if line.startswith("step 1/"))


def test_held_out_evaluation_reports_each_teacher_on_its_aligned_positions(
    cross_store: dict[str, Any], tmp_path: Path
) -> None:
    """4 held-out rows of both teachers, evaluated at the start and the end: each teacher's divergence,
    the other tokenizer's aligned share, and as many evaluated tokens as the held-out rows' trained
    positions of the same tokenizer's teacher plus the aligned ones of the other's (counted from the
    store)."""
    from mopd.train.trainer import held_out_rows, run_training

    store: TeacherStore = cross_store["store"]
    config = train_config(cross_store, tmp_path, cross_store["same"], eval={"rows": 4, "every": 0})
    result = run_training(load_config(config), log=lambda _: None)
    held = held_out_rows(store.num_rows, 4, 0)
    other = next(t.index for t in store.teachers if t.tokenizer is not None)
    assert {store.row(int(i)).teacher_index for i in held} == {t.index for t in store.teachers}
    tokens, aligned, trained = 0, 0, 0
    for i in held.tolist():
        mask = store.row(i).loss_mask.numpy().astype(bool)
        if store.row(i).teacher_index == other:
            aligned += int((store.aligned(i)[mask] >= 0).sum())
            trained += int(mask.sum())
        else:
            tokens += int(mask.sum())
    evaluated = [r for r in result.records if r.get("split") == "eval"]
    assert [r["step"] for r in evaluated] == [0, 3]
    for record in evaluated:
        assert record["trained_tokens"] == tokens + aligned
        assert set(record["divergence_by_teacher"]) == {str(t.index) for t in store.teachers}
        assert record["aligned_share_by_teacher"] == {str(other): aligned / trained}


def retemplated(source: Path, target: Path) -> Path:
    """A copy of `source` whose tokenizer renders chats otherwise (same vocabulary, another fingerprint)."""
    shutil.copytree(source, target)
    settings = json.loads((target / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (target / "tokenizer_config.json").write_text(json.dumps(settings))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    return target


def verify_lines(*args: str) -> tuple[int, list[str]]:
    """`mopd verify-manifest ARGS`: its exit code and output lines."""
    from click.testing import CliRunner

    from mopd.cli.main import cli

    out = CliRunner().invoke(cli, ["verify-manifest", *args])
    return out.exit_code, out.output.splitlines()


def test_a_tokenizer_swapped_after_precompute_is_named_in_one_line(
    cross_store: dict[str, Any], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A student, or a teacher of another tokenizer, whose tokenizer renders otherwise than when the store
    was aligned (same vocabulary, another chat template): `verify-manifest --config` says so in one line
    naming its key and folder (for the teacher, instead of "a different teacher"), and a resume of a run
    checkpointed before the swap refuses with that line. A byte-identical copy of the teacher elsewhere
    is still the store's. (The copies sit in a folder whose path sorts where the original's does, so
    that the teachers keep their numbers.)"""
    from mopd.base.errors import ConfigError
    from mopd.train.trainer import run_training

    store = str(cross_store["store"].root)
    first = tmp_path_factory.mktemp("a-teachers")
    copy = first / "chat-copy"
    shutil.copytree(cross_store["other"], copy)
    config = train_config(cross_store, tmp_path / "copy", cross_store["same"])
    raw = yaml.safe_load(config.read_text())
    raw["teachers"]["chat"] = str(copy)
    config.write_text(yaml.safe_dump(raw))
    assert verify_lines(store, "--config", str(config))[0] == 0
    output = tmp_path / "run"
    run_training(load_config(config), output=output, max_steps=1, log=lambda _: None)
    swaps = {
        "train.student": ("student", retemplated(cross_store["same"], tmp_path / "student")),
        "teachers.chat": ("chat", retemplated(cross_store["other"], first / "chat")),
    }
    for key, (slot, folder) in swaps.items():
        config = train_config(
            cross_store, tmp_path / slot, folder if slot == "student" else cross_store["same"]
        )
        if slot == "chat":
            raw = yaml.safe_load(config.read_text())
            raw["teachers"]["chat"] = str(folder)
            config.write_text(yaml.safe_dump(raw))
        code, lines = verify_lines(store, "--config", str(config))
        assert code == 1 and len(lines) == 1, lines
        assert lines[0].startswith(
            f"{key}: the tokenizer of {folder} is not the one the store's rows were aligned"
        )
        with pytest.raises(ConfigError, match=re.escape(lines[0])) as refused:
            run_training(load_config(config), output=output, resume=True, log=lambda _: None)
        assert "a different teacher" not in str(refused.value)


def test_verify_checkpoint_names_a_store_aligned_with_another_student_tokenizer(
    cross_store: dict[str, Any], tmp_path: Path
) -> None:
    """A checkpoint's run record holds the tokenizers its store was aligned with: against a store of the
    same teachers aligned with another student tokenizer, `verify-manifest --checkpoint` names it in one
    line; against its own store, nothing."""
    from mopd.train.trainer import run_training

    config = train_config(cross_store, tmp_path / "run", cross_store["same"], steps=1)
    result = run_training(load_config(config), log=lambda _: None)
    assert result.checkpoint is not None
    store = str(cross_store["store"].root)
    assert verify_lines(store, "--checkpoint", str(result.checkpoint))[0] == 0
    raw = yaml.safe_load(cross_store["config"].read_text())
    raw["tokenizer"] = str(retemplated(cross_store["same"], tmp_path / "student"))
    raw["store"]["path"] = str(tmp_path / "other.zarr")
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(raw))
    run_precompute(load_config(other), show_progress=False, log=lambda _: None)
    code, lines = verify_lines(str(tmp_path / "other.zarr"), "--checkpoint", str(result.checkpoint))
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(
        f"store.tokenizer: {result.checkpoint} was trained with tokenizer fingerprint "
    )
    assert lines[0].endswith("a resume on it is refused")


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

    def with_projection(path: Path, steps: int) -> Path:
        projection = {"projection": {"chat": str(path)}}
        checkpoint = {"every": 2, "keep": 2}
        return train_config(
            cross_store,
            tmp_path,
            cross_store["same"],
            cross_tokenizer=projection,
            checkpoint=checkpoint,
            steps=steps,
        )

    config = with_projection(first, steps=2)
    run_training(load_config(config), log=lambda _: None)
    with Trainer(load_config(config), log=lambda _: None) as trainer:
        assert trainer.session.projection_fingerprints == {
            other.index: Projection(source, target, weight, **sizes).fingerprint
        }
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("*/state.json")).read_text())
    assert state["run"][PROJECTIONS] == {
        str(other.index): Projection(source, target, weight, **sizes).fingerprint
    }
    again = with_projection(second, steps=3)
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


def train_records(folder: Path) -> list[dict[str, Any]]:
    """The train records of the run under `folder`."""
    from mopd.train.report.metrics import METRICS_FILE, read_metrics

    return [r for r in read_metrics(folder / "run" / METRICS_FILE) if r.get("split", "train") == "train"]


def assert_same_cross_training(got: list[dict[str, Any]], want: list[dict[str, Any]], width: int) -> None:
    """Two runs of a 2-block student on the mixed store, laid out otherwise: the same trained tokens and
    aligned shares, exactly; losses and gradient norms within `assert_same_training`, the span term
    within its loss bound."""
    from tests.tolerance import assert_same_training

    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for mine, theirs in zip(got, want, strict=True):
        assert mine["trained_tokens"] == theirs["trained_tokens"]
        assert mine["aligned_share_by_teacher"] == theirs["aligned_share_by_teacher"]
        assert_close(mine["span"], theirs["span"], rtol=trajectory_rtol(mine["step"], 2, width), what="span")
    assert_same_training(got, want, layers=2, width=width)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["hf", "fsdp"])
def test_two_data_parallel_ranks_with_unequal_cross_tokenizer_work_match_one(
    cross_store: dict[str, Any], tmp_path: Path, backend: str
) -> None:
    """`torchrun --nproc-per-node 2` on the mixed store, replicated (hf) or sharded (fsdp): microbatches
    of 128 tokens deal the ranks unequal shares of each step — rows of the other tokenizer's teacher on
    one rank and not the other, more microbatches on one — yet every rank runs the same collectives, and
    the run equals one rank's (`assert_same_cross_training`; the student: a 2-block llama, 96 wide)."""
    from mopd.train.data.order import epoch_steps, rank_microbatches
    from mopd.train.trainer import run_training
    from tests.distributed.harness import run_torchrun

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
    two = train_config(
        cross_store, tmp_path / "two", cross_store["student"], batch=batch, steps=3, backend=backend
    )
    run_torchrun(["train", str(two)], nproc=2)
    assert_same_cross_training(train_records(tmp_path / "two"), train_records(tmp_path / "one"), width=128)


@pytest.mark.distributed
def test_a_tensor_parallel_megatron_student_trains_as_one_hf_process(
    cross_store: dict[str, Any], tmp_path: Path
) -> None:
    """A Qwen3 student of the store's tokenizer on the megatron backend at TP = 2 (its vocabulary, and so
    each projected distribution and the span likelihoods' softmax, split over the ranks; each rank holds
    the other tokenizer's teacher head whole) trains as the hf backend in one process."""
    from mopd.train.trainer import run_training
    from tests.distributed.harness import run_torchrun
    from tests.precompute.teachers import make_tokenizer, save_teacher

    tokenizer = make_tokenizer()
    student = save_teacher(
        tmp_path / "student", "qwen3", hidden_size=64, seed=13, tokenizer=tokenizer, num_key_value_heads=2
    )
    one = train_config(cross_store, tmp_path / "one", student)
    run_training(load_config(one), log=lambda _: None)
    two = train_config(cross_store, tmp_path / "two", student, backend="megatron", parallel={"tp": 2})
    run_torchrun(["train", str(two)], nproc=2)
    assert_same_cross_training(train_records(tmp_path / "two"), train_records(tmp_path / "one"), width=128)


def reference_spans(store: TeacherStore, rows: list[int]) -> list[tuple[int, list[int], list[int]]]:
    """Each trained span of `rows` (in order) from the stored alignment, by the rule written out: a span
    more than one token long on either side. (row, its trained positions' indices among the
    microbatch's trained tokens, the teacher positions) per span."""
    spans, first = [], 0
    for i in rows:
        mask = store.row(i).loss_mask.numpy()
        if store.teacher(store.row(i).teacher_index).tokenizer is not None:
            alignment = store.alignment(i)
            trained = alignment.student_span[mask]
            for k in range(int(max(trained.max(), alignment.teacher_span.max())) + 1):
                tokens = (first + np.flatnonzero(trained == k)).tolist()
                teacher = np.flatnonzero(alignment.teacher_span == k).tolist()
                if len(tokens) > 1 or len(teacher) > 1:
                    spans.append((i, tokens, teacher))
        first += int(mask.sum())
    return spans


def test_the_span_term_equals_a_float64_reference_from_the_store(cross_store: dict[str, Any]) -> None:
    """The objective's span term over a microbatch of every row (both teachers) equals
    ½ Σ_s w_s (ℓ_student(s) − ℓ_teacher(s))² built from the store by hand in float64 — the spans by the
    rule written out, the teacher's log-probabilities of its own stored tokens from its stored states and
    head, w_s = span_weight × the token weight — and so does its gradient (the objective's with the span
    term on, less the one with it off)."""
    from types import SimpleNamespace

    from mopd.config.train import DivergenceConfig
    from mopd.store.format.transform import LogitTransform
    from mopd.train.data.loader import read_microbatches
    from mopd.train.heads import TeacherHeads
    from mopd.train.objective import Objective
    from tests.tolerance import sum_rtol, value_atol

    store: TeacherStore = cross_store["store"]
    rows = list(range(store.num_rows))
    (mb,) = read_microbatches(store, [np.array(rows)], spans=True)
    spans = reference_spans(store, rows)
    assert mb.spans is not None and mb.spans.count == len(spans) > 3
    assert any(len(s[2]) > 1 for s in spans)  # the teacher merges less: its side is the longer
    vocab = store.manifest.tokenizer.vocab_size
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(mb.num_trained, 24, generator=g)
    head = torch.randn(vocab, 24, generator=g) * 0.5
    teachers = [t.index for t in store.teachers]
    heads = TeacherHeads(
        store, teachers, lifecycle="none", device=torch.device("cpu"), vocab_start=0, vocab_stop=vocab
    )
    norm = torch.full((mb.num_trained,), 1.0 / mb.num_trained)
    grads, terms = [], []
    for weight in (0.7, 0.0):
        objective = Objective(
            DivergenceConfig(chunk_size=16),
            heads,
            {t: 1.0 for t in teachers},
            vocab,
            SimpleNamespace(tp_group=None),  # type: ignore[arg-type]
            vocab_slice=(0, vocab),
            device=torch.device("cpu"),
            span_weight=weight,
        )
        h = hidden.clone().requires_grad_()
        out = objective(h, head, mb, norm)
        out.loss.backward()
        grads.append(h.grad)
        terms.append(out.span)
    assert terms[1] is None and terms[0] is not None

    h64 = hidden.double().requires_grad_()
    student_lp = (h64 @ head.double().T).log_softmax(1).gather(1, mb.labels[:, None])[:, 0]
    want = torch.zeros((), dtype=torch.float64)
    bound = 0.0
    for i, tokens, positions in spans:
        teacher = store.teacher(store.row(i).teacher_index)
        transform = LogitTransform(teacher.logit_scale, teacher.final_logit_softcap)
        logits = transform.apply(
            store.hidden(i)[positions].double() @ store.lm_head(teacher.index).double().T
        )
        own = torch.as_tensor(store.alignment(i).token_ids[np.array(positions) + 1])
        teacher_ll = logits.log_softmax(1).gather(1, own[:, None]).sum()
        gap = student_lp[tokens].sum() - teacher_ll
        want = want + 0.7 / mb.num_trained * 0.5 * gap.square()
        # Each side's log-probabilities round as one token's hard-label value (`value_atol`), a span's
        # likelihood as the sum of its tokens'; the squared gap's error is 2·|gap|·that, times w_s.
        student_range = float((h64[tokens] @ head.double().T).detach().aminmax()[1].max() * 2)
        side = len(tokens) * value_atol(vocab, student_range) + len(positions) * value_atol(
            teacher.vocab_size, float(logits.max() - logits.min())
        )
        bound += 0.7 / mb.num_trained * side * (float(gap.detach().abs()) + side)
    want.backward()
    assert_close(terms[0] * 0.7, want, atol=bound, what="span term")
    scale = bound / 0.7 * float(head.abs().max())  # each token's weight w·gap, off by ≤ w·bound
    assert_close(
        grads[0] - grads[1], h64.grad, atol=scale, rtol=sum_rtol(vocab), norm=True, what="span gradient"
    )

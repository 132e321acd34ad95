"""`mopd train` end to end on real tiny transformers models and real stores (issue 5's acceptance)."""

from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mopd.base.completion import COMPLETE, write_complete
from mopd.base.errors import ConfigError, ManifestError
from mopd.store.format.teachers import TEACHER_LIST_FILE
from mopd.store.reader import TeacherStore, open_store
from mopd.train.checkpoint.state import complete_checkpoints
from mopd.train.objective import teacher_weights
from mopd.train.report.metrics import METRICS_FILE, PLOT_FILE, read_metrics
from mopd.train.trainer import (
    NonFiniteError,
    Trainer,
    TrainResult,
    lr_factor,
    run_training,
)
from tests.tolerance import assert_close, mean_over, perturbed, sum_rtol, trajectory_rtol, value_atol
from tests.train.world import World, world_config

REQUIRED_KEYS = {
    "step",
    "loss",
    "divergence",
    "divergence_by_teacher",
    "divergence_min",
    "divergence_max",
    "grad_norm",
    "tokens_per_s",
    "data_wait",
    "step_seconds",
}


def train(config: Any, **kwargs: Any) -> TrainResult:
    return run_training(config, log=lambda _line: None, **kwargs)


def train_losses(result: TrainResult) -> list[float]:
    return [r["loss"] for r in result.records if r.get("split", "train") == "train"]


def test_self_distillation_starts_at_zero_divergence(world: World, tmp_path: Path) -> None:
    """Student = the teacher's own checkpoint, fp32 store of that teacher: step 1 sees KL ≈ 0 per token."""
    config = world_config(
        world,
        tmp_path,
        store=world.self_store,
        teachers={"math": world.teachers["math"]},
        routing={"default_teacher": "math"},  # as the store was built
        student=world.teachers["math"],
    )
    first = train(config, max_steps=1).records[0]
    assert first["step"] == 1 and first["trained_tokens"] > 100
    # KL ≥ 0 in exact arithmetic; each token's fp32 value rounds within value_atol of it.
    vocab = open_store(world.self_store).teacher(0).vocab_size
    bound = value_atol(vocab, store_logit_range(world.self_store))
    assert_close([first["divergence_min"], first["divergence_max"], first["loss"]], [0.0] * 3, atol=bound)


def store_logit_range(store_path: Path, rows: int = 8) -> float:
    """The largest logit gap of the first rows' rebuilt teacher logits (see tests/tolerance.value_atol)."""
    store = open_store(store_path)
    logits = [store.teacher_logits(i) for i in range(min(rows, store.num_rows))]
    return max(float((z.amax(1) - z.amin(1)).max()) for z in logits)


def test_learning_from_two_teachers_halves_held_out_divergence(world: World, tmp_path: Path) -> None:
    """200 steps from a fresh student: the held-out divergence to each teacher falls by at least half,
    and metrics.jsonl and the PNG plot are written."""
    config = world_config(
        world, tmp_path, steps=200, eval={"rows": 8, "every": 50}, checkpoint={"every": 100, "keep": 1}
    )
    result = train(config)
    evals = [r for r in result.records if r.get("split") == "eval"]
    assert [r["step"] for r in evals] == [0, 50, 100, 150, 200]
    start, end = evals[0]["divergence_by_teacher"], evals[-1]["divergence_by_teacher"]
    assert set(start) == set(end) == {"0", "1"}
    for teacher in start:
        assert end[teacher] <= 0.5 * start[teacher], (teacher, start[teacher], end[teacher])
    print(
        "learning curve (held-out divergence by teacher):",
        [(r["step"], r["divergence_by_teacher"]) for r in evals],
    )

    records = read_metrics(tmp_path / "run" / METRICS_FILE)
    train_records = [r for r in records if r.get("split", "train") == "train"]
    assert [r["step"] for r in train_records] == list(range(1, 201))
    for record in train_records:
        assert set(record) >= REQUIRED_KEYS
        assert all(math.isfinite(record[k]) for k in REQUIRED_KEYS - {"divergence_by_teacher", "step"})
        assert record["divergence_min"] <= record["divergence"] <= record["divergence_max"]
    assert [r["step"] for r in records if r.get("split") == "eval"] == [0, 50, 100, 150, 200]
    png = (tmp_path / "run" / PLOT_FILE).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert [p.name for p in complete_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_00000200"]


def test_throughput_is_of_wall_time_and_counts_the_data_wait(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that takes 0.5 s per read: the step line's rate is tokens over the whole time between
    steps and `data_wait` the share spent waiting for the loader, not the rate of the step alone."""
    trainer = Trainer(world_config(world, tmp_path, steps=3), log=lambda _line: None)
    slow = TeacherStore.hiddens

    def slow_hiddens(store: TeacherStore, rows: np.ndarray) -> list[torch.Tensor]:
        time.sleep(0.5)
        return slow(store, rows)

    monkeypatch.setattr(TeacherStore, "hiddens", slow_hiddens)
    lines: list[str] = []
    trainer.log = lines.append
    records = trainer.run().records
    # The three reads run one after another in the loader's thread, all after the clock starts.
    assert sum(r["step_seconds"] for r in records) >= 3 * 0.5
    for record in records:
        assert_close(record["tokens_per_s"] * record["step_seconds"], record["tokens"], rtol=sum_rtol(2))
        assert 0.0 <= record["data_wait"] <= 1.0
    # Step 1 waits for the whole first read (the loader starts it only when asked): its recorded wait
    # is ≥ 0.5 s whatever the machine's speed, so a clock that missed the wait would fail here.
    assert records[0]["data_wait"] * records[0]["step_seconds"] >= 0.5
    assert lines[0].startswith("training steps 1..3") and " (data wait " in lines[1]


def _student_reference(trainer: Trainer, rows: np.ndarray) -> torch.Tensor:
    """Per trained token, reverse KL between the student's full logits and the row's own teacher logits."""
    values = []
    with torch.no_grad():
        for r in rows:
            row = trainer.store.row(int(r))
            logits = trainer.student.model(input_ids=row.input_ids[None]).logits[0][row.loss_mask]
            teacher = trainer.store.teacher_logits(int(r))[row.loss_mask]
            logp_s, logp_t = logits.log_softmax(-1), teacher.log_softmax(-1)
            values.append((logp_s.exp() * (logp_s - logp_t)).sum(-1))
    return torch.cat(values)


def test_each_row_uses_its_own_teachers_head(world: World, tmp_path: Path) -> None:
    trainer = Trainer(world_config(world, tmp_path, lm_head_lifecycle="none"), log=lambda _line: None)
    step = next(trainer.loader.steps(trainer_state(trainer)))
    mb = step.microbatches[0]
    assert set(mb.teacher_hidden) == {0, 1}, "the first microbatch should mix both teachers"
    with torch.no_grad():
        hidden = trainer.student.hidden_states(mb.input_ids, mb.attention_mask)[mb.loss_mask]
        norm = torch.full((mb.num_trained,), 1.0 / mb.num_trained)
        per_token = trainer.objective(hidden, trainer.student.head, mb, norm).per_token
        # The fused value against log-softmax of materialised logits: one token's rounding, twice.
        bound = value_atol(trainer.objective.vocab_size, store_logit_range(world.store))
        assert_close(per_token, _student_reference(trainer, mb.rows), atol=bound, what="per_token")
        heads = trainer.heads._kept
        heads[0], heads[1] = heads[1], heads[0]
        swapped = trainer.objective(hidden, trainer.student.head, mb, norm).per_token
    # Random teachers sit at similar mean distances from a random student, so the mean barely moves;
    # each token's value does.
    assert float((swapped - per_token).abs().mean()) > 0.1 * float(per_token.mean())


def trainer_state(trainer: Trainer) -> Any:
    from mopd.train.data.order import LoaderState

    return LoaderState(trainer.tc.seed)


def test_a_store_of_one_teachers_rows_trains_as_a_one_teacher_run(world: World, tmp_path: Path) -> None:
    """Two teachers configured, only math rows stored ≡ the math teacher alone: bit-identical losses."""
    both = world_config(world, tmp_path / "both", store=world.math_rows_store, steps=4)
    alone = world_config(
        world,
        tmp_path / "alone",
        store=world.math_teacher_store,
        teachers={"math": world.teachers["math"]},
        steps=4,
    )
    assert open_store(world.math_rows_store).teacher(1).aliases == ["math"]  # math is index 1 there, 0 alone
    a, b = train_losses(train(both)), train_losses(train(alone))
    assert len(a) == 4 and a == b


@pytest.mark.parametrize("lifecycle", ["offload", "evict"])
def test_head_lifecycles_keep_one_head_on_device_and_match_none(
    world: World, tmp_path: Path, lifecycle: str
) -> None:
    reorder = {"divergence": {"chunk_size": 48}} if perturbed() else {}  # other chunks, other order
    resident = train(world_config(world, tmp_path / "none", steps=3, lm_head_lifecycle="none", **reorder))
    managed = train(world_config(world, tmp_path / lifecycle, steps=3, lm_head_lifecycle=lifecycle))
    assert resident.heads_peak_resident == 2
    assert managed.heads_peak_resident == 1
    # Moving heads between devices changes nothing; perturbed, the resident run chunks the loss
    # otherwise: a 3-step trajectory of the 2-block student, as a mean over the step's tokens.
    tokens = min(r["trained_tokens"] for r in resident.records if "trained_tokens" in r)
    rtol = mean_over(tokens, trajectory_rtol(3, layers=2, width=128))
    assert_close(train_losses(managed), train_losses(resident), rtol=rtol, what="losses")


def test_evict_rereads_heads_from_the_store(world: World, tmp_path: Path) -> None:
    trainer = Trainer(world_config(world, tmp_path, steps=2, lm_head_lifecycle="evict"), log=lambda _l: None)
    assert trainer.heads.reads == 0
    trainer.run()
    assert trainer.heads.reads >= 4  # each of 2 teachers, at least once per step


def test_sequence_level_loss_weights_rows_equally(world: World, tmp_path: Path) -> None:
    trainer = Trainer(world_config(world, tmp_path, divergence={"level": "sequence"}), log=lambda _line: None)
    mb = next(trainer.loader.steps(trainer_state(trainer))).microbatches[0]
    with torch.no_grad():
        hidden = trainer.student.hidden_states(mb.input_ids, mb.attention_mask)[mb.loss_mask]
        rows_trained = int(mb.loss_mask.any(1).sum())
        loss, per_token = trainer.objective(
            hidden, trainer.student.head, mb, trainer._token_norm(mb, rows_trained)
        )[:2]
    row_means = [per_token[mb.token_row == b].mean() for b in range(len(mb.rows)) if mb.loss_mask[b].any()]
    # The same values summed in two orders: N terms each, twice the worst case of one.
    assert_close(loss, torch.stack(row_means).mean(), rtol=2 * sum_rtol(mb.num_trained), what="loss")


def test_ce_mix_and_teacher_weights(world: World, tmp_path: Path) -> None:
    trainer = Trainer(world_config(world, tmp_path, lm_head_lifecycle="none"), log=lambda _line: None)
    mb = next(trainer.loader.steps(trainer_state(trainer))).microbatches[0]
    with torch.no_grad():
        hidden = trainer.student.hidden_states(mb.input_ids, mb.attention_mask)[mb.loss_mask]
        norm = torch.full((mb.num_trained,), 1.0 / mb.num_trained)
        base, per_token = trainer.objective(hidden, trainer.student.head, mb, norm)[:2]
        logits = trainer.student.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        ce = torch.nn.functional.cross_entropy(
            logits[mb.loss_mask], mb.labels, ignore_index=-100, reduction="sum"
        )
        trainer.objective.cfg = trainer.objective.cfg.model_copy(update={"ce_weight": 0.5})
        terms = trainer.objective(hidden, trainer.student.head, mb, norm)
        mixed, ce_term = terms.loss, terms.ce
        # The fused hard-label CE against torch's, per token within value_atol; the difference of two
        # losses of N summed terms also carries their own sums' rounding.
        vocab = trainer.objective.vocab_size
        atol = 0.5 * value_atol(vocab, store_logit_range(world.store)) + 2 * sum_rtol(mb.num_trained) * float(
            mixed.abs() + base.abs()
        )
        assert_close(mixed - base, 0.5 * ce / mb.num_trained, atol=atol, what="CE term")
        assert ce_term is not None  # the term itself, as step lines and metrics.jsonl report it
        assert_close(0.5 * ce_term, 0.5 * ce / mb.num_trained, atol=atol, what="reported CE term")
        trainer.objective.cfg = trainer.objective.cfg.model_copy(update={"ce_weight": 0.0})
        trainer.objective.weight_of[0] = 3.0
        weighted = trainer.objective(hidden, trainer.student.head, mb, norm).loss
    expected = (per_token * torch.where(mb.teacher_index == 0, 3.0, 1.0)).sum() / mb.num_trained
    assert_close(weighted, expected, rtol=2 * sum_rtol(mb.num_trained), what="weighted loss")


def test_teacher_weights_follow_the_stores_aliases(world: World) -> None:
    manifest = open_store(world.store).manifest
    assert teacher_weights(manifest, {"math": 2.0}) == {0: 1.0, 1: 2.0}  # code is 0, math is 1
    with pytest.raises(ConfigError, match=r"teacher_weights\.chat: the store has no teacher under"):
        teacher_weights(manifest, {"chat": 2.0})
    teachers = [
        t.model_copy(update={"aliases": [*t.aliases, "algebra"]}) if t.index == 1 else t
        for t in manifest.teachers
    ]
    shared = manifest.model_copy(update={"teachers": teachers})
    assert teacher_weights(shared, {"math": 2.0, "algebra": 2.0})[1] == 2.0
    with pytest.raises(ConfigError, match=r"aliases \['algebra', 'math'\] share teacher 1"):
        teacher_weights(shared, {"math": 2.0})


def _truncated_run(config: Any, crash_at: int, monkeypatch: pytest.MonkeyPatch) -> None:
    original = Trainer.train_step

    def crashing(self: Trainer, step: int, batch: Any) -> dict:
        if step == crash_at:
            raise KeyboardInterrupt("killed")
        return original(self, step, batch)

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "train_step", crashing)
        with pytest.raises(KeyboardInterrupt):
            train(config)


def test_resume_after_a_crash_continues_exactly(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed during step 4 (checkpoints every 2), resumed to 6, resumed again to 8: steps 3..8 equal the
    uninterrupted run within 1e-6 and metrics.jsonl holds every step once."""
    options = dict(steps=8, checkpoint={"every": 2, "keep": 2})
    whole = train_losses(train(world_config(world, tmp_path / "whole", **options)))
    config = world_config(world, tmp_path / "parts", **options)
    _truncated_run(config, crash_at=4, monkeypatch=monkeypatch)
    run = tmp_path / "parts" / "run"
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step_00000002"]
    assert [r["step"] for r in read_metrics(run / METRICS_FILE)] == [1, 2, 3]
    first = train(config, max_steps=6)
    second = train(config)
    assert (first.first_step, first.last_step, second.first_step, second.last_step) == (3, 6, 7, 8)
    resumed = [r["loss"] for r in read_metrics(run / METRICS_FILE)]
    assert [r["step"] for r in read_metrics(run / METRICS_FILE)] == list(range(1, 9))
    assert_close(resumed, whole, what="losses")  # the same arithmetic in one process: bit for bit
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step_00000006", "step_00000008"]
    finished = train(config)  # a third resume finds nothing left and changes nothing
    assert finished.records == [] and len(read_metrics(run / METRICS_FILE)) == 8


def _edit_teacher_list(checkpoint: Path, edit: str) -> None:
    path = checkpoint / TEACHER_LIST_FILE
    teachers = json.loads(path.read_text())["teachers"]
    if edit == "renumbered":
        teachers[0]["index"], teachers[1]["index"] = teachers[1]["index"], teachers[0]["index"]
    elif edit == "dropped":
        teachers.pop()
    elif edit == "added":
        teachers.append({"index": 2, "checkpoint": "/elsewhere/teacher", "fingerprint": "f" * 64})
    else:
        teachers[0]["fingerprint"] = "0" * 64
    path.write_text(json.dumps({"teachers": teachers}))
    marker = json.loads((checkpoint / COMPLETE).read_text())
    write_complete(checkpoint, {"step": marker["step"]})  # an intact checkpoint of another store


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("renumbered", "renumbered"),
        ("dropped", "dropped from the checkpoint"),
        ("added", "added in the checkpoint"),
        ("refingerprinted", "fingerprint changed"),
    ],
)
def test_resume_refuses_a_different_teacher_list(
    world: World, tmp_path: Path, edit: str, message: str
) -> None:
    config = world_config(world, tmp_path, steps=4)
    checkpoint = train(config, max_steps=1).checkpoint
    assert checkpoint is not None
    _edit_teacher_list(checkpoint, edit)
    with pytest.raises(ManifestError, match=message) as err:
        train(config)
    assert "cannot resume" in str(err.value)


def test_no_resume_refuses_a_run_folder_with_checkpoints(world: World, tmp_path: Path) -> None:
    config = world_config(world, tmp_path, steps=4)
    train(config, max_steps=1)
    with pytest.raises(ConfigError, match="--resume"):
        train(config, resume=False)


def test_non_finite_loss_stops_before_the_update(world: World, tmp_path: Path) -> None:
    config = world_config(world, tmp_path, steps=3, checkpoint={"every": 1, "keep": 3})
    trainer = Trainer(config, log=lambda _line: None)
    trainer.run(max_steps=1)
    final_norm = trainer.student.model.base_model.norm.weight
    with torch.no_grad():
        final_norm[0] = float("nan")
    before = {n: p.detach().clone() for n, p in trainer.student.model.named_parameters()}
    steps = trainer.loader.steps(trainer_state(trainer))
    with pytest.raises(NonFiniteError, match=r"step 2: non-finite divergence on rank 0 for teacher") as err:
        trainer.train_step(2, next(steps))
    assert "step_00000001 is untouched" in str(err.value)
    for name, param in trainer.student.model.named_parameters():
        torch.testing.assert_close(param, before[name], equal_nan=True, rtol=0, atol=0)
    assert trainer.optimizer.state_dict()["state"][0]["step"] == 1


def test_a_tied_student_trains_and_resumes_exactly(world: World, tmp_path: Path) -> None:
    """Tied embeddings: the head is the embedding matrix (one parameter, both gradients), checkpoints
    omit the duplicate and resuming re-ties it."""
    from transformers import AutoTokenizer

    from tests.precompute.teachers import save_teacher

    tokenizer = AutoTokenizer.from_pretrained(world.student)
    student = save_teacher(
        tmp_path / "tied", "llama", hidden_size=64, seed=5, tokenizer=tokenizer, tie_word_embeddings=True
    )
    options = dict(steps=3, checkpoint={"every": 1, "keep": 3})
    trainer = Trainer(world_config(world, tmp_path / "a", student=student, **options), log=lambda _line: None)
    assert trainer.student.head is trainer.student.model.get_input_embeddings().weight
    whole = train_losses(trainer.run())
    config = world_config(world, tmp_path / "b", student=student, **options)
    train(config, max_steps=2)
    resumed = train(config)
    assert resumed.first_step == 3
    assert_close(train_losses(resumed), whole[2:], what="losses")  # bit for bit
    assert whole[-1] < whole[0]


def test_learning_rate_warms_up_then_decays_to_zero() -> None:
    factors = [lr_factor(s, warmup=4, total=20) for s in range(21)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(factors[3:]))
    assert factors[12] == pytest.approx(0.5) and factors[20] == pytest.approx(0.0)

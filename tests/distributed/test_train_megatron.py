"""`mopd train` on the megatron backend: at TP2×PP2 (with sequence parallelism) under the real launcher
(`torchrun --nproc-per-node 4`), at TP2×DP2 and PP2×DP2 and for the resumes on the harness's ranks
running the same command (`run_mopd`), each gives the single-process hf run's 5 steps; only the last
pipeline stage holds teacher heads; a TP2×PP2 run resumes exactly, resumes at TP1×PP2 and TP2×PP1
(megatron-core's distributed checkpoint), refuses another teacher list, and exports an HF student with
the trained model's logits. The student is a Qwen3 (the Llama and Qwen2 conversions train in
test_megatron_student.py)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from mopd.config.mopd_config import load_config
from mopd.train.report.metrics import METRICS_FILE, read_metrics
from mopd.train.trainer import TrainResult, run_training
from tests.distributed.harness import run_distributed, run_mopd, run_torchrun
from tests.precompute.teachers import assert_same_chat_tokens, make_tokenizer, save_teacher
from tests.tolerance import (
    assert_close,
    assert_same_training,
    learned,
    mean_over,
    network_rtol,
    perturbed,
    trajectory_rtol,
)
from tests.train.world import World, write_train_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TRAIN_LR = 5.0e-3  # the world config's learning rate
TRAIN = dict(
    steps=5,
    batch={"micro_batch_tokens": 256, "global_batch_tokens": 1024},
    eval={"rows": 8, "every": 0},
    checkpoint={"every": 3, "keep": 5},
)


def parallel(tp: int, pp: int) -> dict:
    """`train.parallel` of a layout; TP2×PP2 also splits the sequence over its TP ranks."""
    return {"tp": tp, "pp": pp, "sequence_parallel": (tp, pp) == (2, 2)}


@dataclass(frozen=True)
class Setup:
    world: World
    student: Path  # a tied Qwen3 student whose heads and KV heads split over two TP ranks
    root: Path

    def config(self, name: str, *, store: Path | None = None, **train: object) -> Path:
        return write_train_config(
            self.root / name,
            self.world.teachers,
            data=self.world.data,
            store=store or self.world.store,
            student=self.student,
            **{**TRAIN, **train},
        )


@dataclass(frozen=True)
class Launched:
    output: Path
    log: str


@pytest.fixture(scope="module")
def setup(world: World, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("megatron-train")
    student = save_teacher(  # Qwen3: per-head q/k norms, whose gradients sum over the TP ranks
        root / "student",
        "qwen3",
        hidden_size=64,
        seed=13,
        tokenizer=make_tokenizer(),
        num_key_value_heads=2,
        tie_word_embeddings=True,  # at pp 2: two copies of the embedding, one on each stage
    )
    return Setup(world, student, root)


@pytest.fixture(scope="module")
def single(setup: Setup) -> TrainResult:
    """The reference: the hf backend in one process (perturbed: other microbatches and chunks)."""
    reorder = dict(batch={**TRAIN["batch"], "micro_batch_tokens": 128}, divergence={"chunk_size": 48})
    config = load_config(setup.config("hf", **(reorder if perturbed() else {})))
    return run_training(config, output=setup.root / "hf-run", log=lambda _line: None)


@pytest.fixture(scope="module")
def launch(setup: Setup) -> Callable[[int, int], Launched]:
    """`mopd train` on 4 ranks at a layout, once per layout per module."""
    done: dict[tuple[int, int], Launched] = {}

    def run(tp: int, pp: int) -> Launched:
        if (tp, pp) not in done:
            name = f"tp{tp}pp{pp}"
            config = setup.config(name, backend="megatron", parallel=parallel(tp, pp))
            output = setup.root / f"{name}-run"
            args = ["train", str(config), "--output", str(output)]
            if (tp, pp) == (2, 2):  # the real launcher, and the export of the trained student
                log = run_torchrun([*args, "--export-hf", str(setup.root / f"{name}-hf")], nproc=4)
            else:
                log = run_mopd(args, nproc=4)
            done[(tp, pp)] = Launched(output, log)
        return done[(tp, pp)]

    return run


def split(records: list[dict]) -> tuple[list[dict], list[dict]]:
    train = [r for r in records if r.get("split", "train") == "train"]
    return train, [r for r in records if r.get("split") == "eval"]


def heads_by_rank(log: str) -> list[float]:
    line = re.search(r"teacher heads held by rank: (.*)", log)
    assert line is not None, log[-2000:]
    return [float(size) for size in re.findall(r"\d+: ([\d.]+) MiB", line.group(1))]


@pytest.mark.parametrize(("tp", "pp"), [(2, 2), (2, 1), (1, 2)])
def test_layouts_match_single_process_hf(
    setup: Setup, single: TrainResult, launch: Callable[[int, int], Launched], tp: int, pp: int
) -> None:
    """5 steps (several microbatches per replica, held-out eval at steps 0 and 5) equal the hf run
    within `assert_same_training`'s bounds; teacher heads are held by the last stage's ranks only, each
    its vocabulary slice."""
    run = launch(tp, pp)
    assert run.log.count("step 5/5") == 1  # rank 0 alone logs
    got_train, got_eval = split(read_metrics(run.output / METRICS_FILE))
    want_train, want_eval = split(single.records)
    assert [r["step"] for r in got_train] == [1, 2, 3, 4, 5]
    assert [r["trained_tokens"] for r in got_train] == [r["trained_tokens"] for r in want_train]
    assert_same_training(got_train, want_train, layers=2, width=128)  # a 2-block student, 128 wide
    assert [r["step"] for r in got_eval] == [0, 5]
    for mine, theirs in zip(got_eval, want_eval, strict=True):  # a mean over the held-out rows' tokens
        rtol = mean_over(theirs["trained_tokens"], trajectory_rtol(max(1, mine["step"]), layers=2, width=128))
        assert_close(mine["divergence"], theirs["divergence"], rtol=rtol, what=f"eval {mine['step']}")

    from transformers import AutoConfig

    from mopd.mcore.convert import GPTShape

    padded = GPTShape.from_hf_config(AutoConfig.from_pretrained(setup.student)).padded_vocab_size(tp)
    slice_mib = 2 * (padded // tp) * 64 * 4 / 2**20  # two fp32 teacher heads of hidden 64, one slice
    last_stage = [rank >= 4 - 4 // pp for rank in range(4)]  # megatron-core puts pp outermost
    held = heads_by_rank(run.log)
    assert held == pytest.approx([slice_mib if last else 0.0 for last in last_stage], abs=0.006)


def test_activation_checkpointing_trains_the_same_values(setup: Setup, single: TrainResult) -> None:
    """TP2×PP2 with sequence parallelism, every layer recomputed in the backward: the hf run's 5 steps
    within `assert_same_training`, as without recomputation."""
    config = setup.config(
        "recompute", backend="megatron", parallel=parallel(2, 2), activation_checkpointing=True
    )
    run_mopd(["train", str(config), "--output", str(setup.root / "recompute-run")], nproc=4)
    got = split(read_metrics(setup.root / "recompute-run" / METRICS_FILE))[0]
    assert_same_training(got, split(single.records)[0], layers=2, width=128)
    # The same values, because each layer ran through megatron-core's recomputation: once per layer and
    # microbatch in the forward (one process, one stage of 2 layers; none without the setting).
    configs = [
        setup.config(f"recompute-{int(on)}", backend="megatron", activation_checkpointing=on)
        for on in (False, True)
    ]
    calls = run_distributed(_recomputed_layers, world_size=1, args=([str(c) for c in configs],), timeout=300)[
        0
    ]
    assert calls[0] == 0 and calls[1] > 0 and calls[1] % 2 == 0


def test_mixed_precision_under_tp2_pp2_follows_the_fp32_run(setup: Setup, single: TrainResult) -> None:
    """TP2×PP2 with recomputation, bf16 compute: the fp32 hf run's 5 steps within bf16 rounding (the
    stages send each other what autocast leaves in fp32, the residual stream); the checkpoint's weights
    and AdamW moments are fp32. (Sequence parallelism is refused with it: `TrainConfig`.)"""
    from tests.train.test_precision import assert_bf16_of

    config = setup.config(
        "bf16",
        backend="megatron",
        parallel={"tp": 2, "pp": 2},
        mixed_precision="bf16",
        activation_checkpointing=True,
    )
    output = setup.root / "bf16-run"
    run_mopd(["train", str(config), "--output", str(output)], nproc=4)
    assert_bf16_of(split(read_metrics(output / METRICS_FILE))[0], split(single.records)[0])
    saved = sorted((output / "checkpoints").glob("step_*"))[-1]
    tensors = whole_tensors(saved / "state")  # the weights and AdamW moments of every slice and stage
    assert len(tensors) > 20 and {t.dtype for t in tensors.values()} == {torch.float32}


def _recomputed_layers(rank: int, world: int, configs: list[str]) -> list[int]:
    """How often megatron-core's activation checkpointing ran in one step of each config."""
    from megatron.core import tensor_parallel

    counted = []
    original = tensor_parallel.checkpoint
    for config in configs:
        calls = 0

        def counting(*args: object) -> object:
            nonlocal calls
            calls += 1
            return original(*args)

        tensor_parallel.checkpoint = counting
        try:
            run_training(
                load_config(config), output=Path(config).parent / "run", max_steps=1, log=lambda _l: None
            )
        finally:
            tensor_parallel.checkpoint = original
        counted.append(calls)
    return counted


def test_resume_under_tp2_pp2_matches_uninterrupted(
    setup: Setup, launch: Callable[[int, int], Launched]
) -> None:
    """From the step-3 checkpoint, steps 4 and 5 and the final weights equal the uninterrupted run's;
    sequence parallelism, on in that run, is off here (it does not change how weights are laid out)."""
    whole = launch(2, 2)
    resumed = setup.root / "tp2pp2-resumed"
    shutil.copytree(whole.output / "checkpoints" / "step_00000003", resumed / "checkpoints" / "step_00000003")
    config = setup.config("tp2pp2-no-sp", backend="megatron", parallel={"tp": 2, "pp": 2})
    log = run_mopd(["train", str(config), "--output", str(resumed), "--resume"], nproc=4)
    assert "(step 3)" in log  # resumed from the copied checkpoint
    got = {r["step"]: r for r in split(read_metrics(resumed / METRICS_FILE))[0]}
    want = {r["step"]: r for r in split(read_metrics(whole.output / METRICS_FILE))[0]}
    assert sorted(got) == [4, 5]
    # From the same step-3 weights, sequence parallelism off sums the norms' gradients in another order:
    # two steps of diverging rounding.
    assert_same_training([got[4], got[5]], [want[4], want[5]], layers=2, width=128, since=3)
    # AdamW moves a weight by at most lr·(1 + |w|·weight_decay) ≈ lr per step; a direction that rounds
    # within trajectory_rtol of another moves it at most that fraction of lr apart, twice.
    atol = 2 * TRAIN_LR * trajectory_rtol(2, layers=2, width=128)
    final = "checkpoints/step_00000005/state"
    a, b = whole_tensors(whole.output / final), whole_tensors(resumed / final)
    assert sorted(a) == sorted(b) and any(name.startswith("decoder.") for name in a)
    for name in a:
        if not name.startswith("optimizer."):
            assert_close(a[name], b[name], atol=atol, what=name)


def whole_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a megatron checkpoint's distributed state, whole (its slices joined), read in
    this process with torch's own reader of the format megatron-core writes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    tensors = {
        name: torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, meta in entries.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(tensors, checkpoint_id=str(folder), no_dist=True)
    return tensors


@pytest.mark.parametrize(("tp", "pp", "ranks"), [(1, 2, 2), (2, 1, 2)])
def test_resume_at_another_tensor_and_pipeline_layout(
    setup: Setup, launch: Callable[[int, int], Launched], tp: int, pp: int, ranks: int
) -> None:
    """The TP2×PP2 run's step-3 checkpoint (4 ranks) resumes at TP1×PP2 and TP2×PP1 on 2 ranks:
    megatron-core's distributed checkpoint re-cuts weights and AdamW moments for the new slices and
    stages (the vocabulary padding too: 128·tp rows), and steps 4 and 5 follow the uninterrupted run
    within trajectory tolerance (the same values, summed over other slices from step 4 on)."""
    whole = launch(2, 2)
    resumed = setup.root / f"tp2pp2-at-tp{tp}pp{pp}"
    shutil.copytree(whole.output / "checkpoints" / "step_00000003", resumed / "checkpoints" / "step_00000003")
    config = setup.config(f"tp{tp}pp{pp}-resume", backend="megatron", parallel={"tp": tp, "pp": pp})
    log = run_mopd(["train", str(config), "--output", str(resumed), "--resume"], nproc=ranks)
    assert "(step 3)" in log
    got = {r["step"]: r for r in split(read_metrics(resumed / METRICS_FILE))[0]}
    want = {r["step"]: r for r in split(read_metrics(whole.output / METRICS_FILE))[0]}
    assert sorted(got) == [4, 5]
    assert_same_training([got[4], got[5]], [want[4], want[5]], layers=2, width=128, since=3)
    # The AdamW moments came along: at step 5 they are the uninterrupted run's. They are linear (exp_avg)
    # and quadratic (exp_avg_sq) in gradients that differ by two steps of rounding; moments restarted
    # from zero would hold a third of the history.
    final = "checkpoints/step_00000005/state"
    a, b = whole_tensors(whole.output / final), whole_tensors(resumed / final)
    moments = [name for name in a if name.startswith("optimizer.exp_avg")]
    assert sorted(a) == sorted(b) and len(moments) > 10
    for name in moments:
        rows = min(a[name].shape[0], b[name].shape[0])  # the vocabulary padded to 128·tp rows
        rtol = (2 if "exp_avg_sq" in name else 1) * trajectory_rtol(2, layers=2, width=128)
        assert_close(b[name][:rows], a[name][:rows], rtol=rtol, norm=True, what=name)


def _check_exported(
    rank: int, world: int, student: str, checkpoint: str, tokens: torch.Tensor, refusals: list[str]
) -> dict:
    """TP2×PP2: the checkpoint's logits; then the trainer's refusals, each as the error it raised."""
    from megatron.core import parallel_state

    from mopd.base.errors import MopdError
    from mopd.config.parallel import ParallelConfig
    from mopd.mcore.parallel import ModelParallelGroup
    from mopd.train.backends.megatron import MegatronStudent
    from mopd.train.trainer import Trainer

    group = ModelParallelGroup.start(ParallelConfig(tp=2, pp=2), torch.device("cpu"), what="train.parallel")
    try:
        model = MegatronStudent(student, group=group, dtype=torch.float32)
        model.load_state(Path(checkpoint), None)
        model.train(False)

        def logits(hidden: torch.Tensor, head: torch.Tensor, mb: object) -> tuple[torch.Tensor, torch.Tensor]:
            local = hidden @ head.T
            parts = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(parts, local, group=parallel_state.get_tensor_model_parallel_group())
            return local.sum() * 0, torch.cat(parts, 1)[:, : model.output_rows]

        @dataclass
        class Rows:
            input_ids: torch.Tensor
            loss_mask: torch.Tensor

        with torch.no_grad():
            out = model.forward_backward(
                [Rows(tokens, torch.ones_like(tokens, dtype=torch.bool))], logits, forward_only=True
            )
    finally:
        group.close()
    errors = []
    for config in refusals:
        try:
            Trainer(load_config(Path(config)), output=Path(config).parent / "run").run(resume=True)
            errors.append("")
        except MopdError as err:
            errors.append(f"{type(err).__name__}: {err}")
    return {"logits": out[0] if model.reports else None, "errors": errors}


def test_export_and_refusals(setup: Setup, launch: Callable[[int, int], Launched]) -> None:
    """The exported HF student reloads with the trained TP2×PP2 model's logits within 1e-5; resuming that
    run against a store of other teachers is refused, naming what differs."""
    run = launch(2, 2)
    exported = AutoModelForCausalLM.from_pretrained(setup.root / "tp2pp2-hf", dtype=torch.float32)
    assert_same_chat_tokens(setup.root / "tp2pp2-hf", setup.student)  # the chat template came along
    tokens = torch.randint(0, exported.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = exported(input_ids=tokens).logits.reshape(-1, exported.config.vocab_size)

    refusals = []
    for name, store, layout in (("other-teachers", setup.world.math_teacher_store, parallel(2, 2)),):
        config = setup.config(name, store=store, backend="megatron", parallel=layout)
        shutil.copytree(run.output / "checkpoints", config.parent / "run" / "checkpoints")
        refusals.append(str(config))
    results = run_distributed(
        _check_exported,
        world_size=4,
        args=(str(setup.student), str(run.output / "checkpoints" / "step_00000005"), tokens, refusals),
        timeout=300,
    )
    got = next(r["logits"] for r in results if r["logits"] is not None)
    assert_close(got, want, rtol=network_rtol(setup.student), norm=True, what="exported logits")
    (teachers,) = results[0]["errors"]
    assert teachers.startswith("ManifestError") and "teacher list differs" in teachers


def test_data_parallel_replicas_shard_adamw_and_resume_on_another_count(
    setup: Setup, launch: Callable[[int, int], Launched]
) -> None:
    """TP2×DP2: each replica keeps its share of the AdamW state (torch's ZeroRedundancyOptimizer); the
    step-3 checkpoint holds the whole state, and resumes bit for bit on the same layout and within
    trajectory tolerance at TP2×DP1 (2 ranks: the data-parallel size is not part of the run)."""
    whole = launch(2, 1)
    want = {r["step"]: r for r in split(read_metrics(whole.output / METRICS_FILE))[0]}
    for name, ranks in (("same", 4), ("fewer", 2)):
        resumed = setup.root / f"tp2dp2-resumed-{name}"
        shutil.copytree(
            whole.output / "checkpoints" / "step_00000003", resumed / "checkpoints" / "step_00000003"
        )
        config = setup.config(f"tp2-{name}", backend="megatron", parallel=parallel(2, 1))
        log = run_mopd(["train", str(config), "--output", str(resumed), "--resume"], nproc=ranks)
        assert "(step 3)" in log
        got = {r["step"]: r for r in split(read_metrics(resumed / METRICS_FILE))[0]}
        assert sorted(got) == [4, 5]
        if ranks == 4:
            assert learned([got[4], got[5]]) == learned([want[4], want[5]])
        else:  # one replica sums what two did: other rounding from step 4 on
            assert_same_training([got[4], got[5]], [want[4], want[5]], layers=2, width=128, since=3)

    config = setup.config("shares", backend="megatron", parallel=parallel(2, 1))
    shares = run_distributed(_adamw_share, world_size=4, args=(str(config),), timeout=300)
    # Megatron puts tp innermost: ranks t and t + 2 are the two replicas of tensor-parallel slice t.
    for t in (0, 1):
        (first, whole_slice), (second, other) = shares[t], shares[t + 2]
        assert whole_slice == other and 0 < first < whole_slice and 0 < second < whole_slice
        assert first + second == whole_slice  # each moment on exactly one replica


def _adamw_share(rank: int, world: int, config: str) -> tuple[int, int]:
    """(AdamW state elements this rank holds, state elements of its whole slice) after one step."""
    from mopd.train.trainer import Trainer

    trainer = Trainer(load_config(config), log=lambda _l: None)
    close, trainer.session.close = trainer.session.close, lambda: None
    try:
        trainer.run(max_steps=1)
        local = trainer.optimizer.optim.state  # type: ignore[attr-defined]
        held = sum(v.numel() for s in local.values() for k, v in s.items() if k.startswith("exp_avg"))
        whole = 2 * sum(p.numel() for p in trainer.student.parameters())
    finally:
        close()
    return held, whole

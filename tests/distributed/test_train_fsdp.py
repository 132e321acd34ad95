"""The `fsdp` backend on real gloo ranks: the same training as one `hf` process, head gradients reduced
over the ranks, ranks with different microbatch counts, and sharded checkpoints that resume on any rank
count."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from mopd.base.fsio import is_temporary
from mopd.cli.main import cli
from mopd.store.reader import open_store
from mopd.train.checkpoint.state import complete_checkpoints
from mopd.train.data.order import epoch_steps, rank_microbatches
from mopd.train.report.metrics import METRICS_FILE, read_metrics
from mopd.train.trainer import run_training
from tests.distributed.harness import run_distributed, run_torchrun
from tests.tolerance import (
    assert_close,
    assert_same_training,
    forward_rtol,
    learned,
    mean_over,
    network_rtol,
    perturbed,
    sum_rtol,
    trajectory_rtol,
)
from tests.train.world import World, world_config

# Microbatches of 192 tokens in steps of 1024: ranks run several, and not always as many as each other.
# 8 rows held out, evaluated at steps 0, 5 and 10.
OPTIONS: dict[str, Any] = dict(
    steps=10, batch={"micro_batch_tokens": 192, "global_batch_tokens": 1024}, eval={"rows": 8, "every": 5}
)


def _train(
    rank: int, world_size: int, world: World, folder: str, options: dict, output: str, stop: int
) -> Any:
    config = world_config(world, Path(folder) / f"rank{rank}", **options)
    result = run_training(config, output=output, max_steps=stop, log=lambda _line: None)
    return result.records if rank == 0 else None


def train_fsdp(
    world: World, tmp_path: Path, ranks: int, output: Path, stop: int, **options: Any
) -> list[dict]:
    """`stop` steps of an fsdp run on `ranks` gloo ranks (resuming what `output` holds)."""
    options = {**OPTIONS, "backend": "fsdp", **options}
    args = (world, str(tmp_path / "configs"), options, str(output), stop)
    return run_distributed(_train, world_size=ranks, args=args, timeout=300)[0]


def reference(world: World, tmp_path: Path, **options: Any) -> list[dict]:
    """One `hf` process, the same global batches (perturbed: other microbatches and chunks)."""
    options = {**OPTIONS, **options}
    if perturbed():
        options |= dict(batch={**options["batch"], "micro_batch_tokens": 128}, divergence={"chunk_size": 48})
    result = run_training(
        world_config(world, tmp_path / "reference", **options), output=tmp_path / "hf", log=lambda _l: None
    )
    return result.records


def split(records: list[dict], name: str) -> list[dict]:
    """The train (or eval) records of a run."""
    return [r for r in records if r.get("split", "train") == name]


def unequal_steps(world: World, ranks: int) -> int:
    """How many of an epoch's steps give the ranks different microbatch counts."""
    lengths = open_store(world.store).lengths
    steps = epoch_steps(lengths, seed=0, epoch=0, global_batch_tokens=1024)
    counts = [
        {
            len(rank_microbatches(rows, lengths, dp_rank=r, dp_size=ranks, micro_batch_tokens=192))
            for r in range(ranks)
        }
        for rows in steps
    ]
    return sum(len(c) > 1 for c in counts)


@pytest.mark.parametrize(
    ("ranks", "recompute", "parallel"),
    [
        (2, False, {}),
        (3, False, {"gradient_sync": "step"}),
        (2, True, {}),
        (4, False, {"dp_replicate": 2}),
    ],
)
def test_fsdp_trains_as_one_hf_process(
    world: World, tmp_path: Path, ranks: int, recompute: bool, parallel: dict
) -> None:
    """10 steps at 2, 3 and 4 ranks: losses and gradient norms of one process within
    `assert_same_training` — also on the steps where ranks run different microbatch counts (fillers: no
    hang, no change), with gradients reduced after every microbatch or once a step, sharded within two
    replicas (HSDP), and with activation checkpointing (the blocks' activations recomputed: the same
    values)."""
    assert unequal_steps(world, ranks) > 0  # the case is exercised
    options = dict(activation_checkpointing=recompute, parallel=parallel)
    records = train_fsdp(world, tmp_path, ranks, tmp_path / "fsdp", 10, **options)
    hf = reference(world, tmp_path)
    want, sharded = split(hf, "train"), split(records, "train")
    assert [r["trained_tokens"] for r in sharded] == [r["trained_tokens"] for r in want]
    assert_same_training(sharded, want, layers=2, width=128)  # the world's 2-block student, 128 wide
    # Held-out evaluation on the sharded student: the same forward (no backward) over the held-out rows.
    evaluated, want_eval = split(records, "eval"), split(hf, "eval")
    assert [r["step"] for r in evaluated] == [0, 5, 10]
    for mine, theirs in zip(evaluated, want_eval, strict=True):
        assert mine["trained_tokens"] == theirs["trained_tokens"]
        rtol = trajectory_rtol(mine["step"], 2, 128) + forward_rtol(2, 128)
        for key in ("divergence_min", "divergence_max"):
            assert_close(mine[key], theirs[key], rtol=rtol, what=f"eval {mine['step']} {key}")
        assert_close(mine["divergence"], theirs["divergence"], rtol=mean_over(theirs["trained_tokens"], rtol))
    assert read_metrics(tmp_path / "fsdp" / METRICS_FILE)[-1]["step"] == 10


def _head_gradient(
    rank: int, world_size: int, backend: str, student: str, batches: list[list[torch.Tensor]]
) -> Any:
    """The whole output-layer and embedding gradients after this rank's microbatches (of `batches[rank]`,
    maybe none), each loss Σ logsumexp(hidden · headᵀ) over its tokens."""
    from torch.distributed.tensor import DTensor

    from mopd.train.backends.fsdp import FSDPStudent
    from mopd.train.backends.groups import RankGroup
    from mopd.train.backends.hf import HFStudent

    kind = FSDPStudent if backend == "fsdp" else HFStudent
    model = kind(student, device=torch.device("cpu"), dtype=torch.float32, dp=RankGroup(rank, world_size))

    class Batch:
        def __init__(self, ids: torch.Tensor) -> None:
            self.input_ids, self.attention_mask = ids, torch.ones_like(ids)
            self.loss_mask = torch.ones_like(ids, dtype=torch.bool)

    def loss_fn(hidden: torch.Tensor, head: torch.Tensor, mb: Any) -> tuple[torch.Tensor, None]:
        return (hidden @ head.T).logsumexp(-1).sum(), None

    model.forward_backward([Batch(ids) for ids in batches[rank]], loss_fn)
    model.finish_gradients()
    grads = {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for name, p in model.model.named_parameters()
    }
    return {name: grads[name] for name in ("lm_head.weight", "model.embed_tokens.weight") if name in grads}


@pytest.mark.parametrize(
    ("backend", "ranks", "tied"),
    [("fsdp", 2, False), ("fsdp", 3, False), ("fsdp", 3, True), ("hf", 3, False), ("hf", 3, True)],
)
def test_the_heads_gradient_is_summed_over_the_ranks(
    world: World, tmp_path: Path, backend: str, ranks: int, tied: bool
) -> None:
    """Each rank's own tokens reach the head through the loss only: the whole gradient is the sum over
    every rank's microbatches (a head gathered without reduction would hold one rank's share; an
    averaging reduction, DistributedDataParallel's default, 1/W of the sum). Rank 0 runs two
    microbatches, rank 1 one, a third rank none (fillers only). Tied: the embedding matrix is the head
    (under fsdp one unit), its gradient from both uses. `hf`: whole replicas under torch's DDP."""
    from mopd.train.backends.groups import RankGroup
    from mopd.train.backends.hf import HFStudent
    from tests.precompute.teachers import make_tokenizer, save_teacher

    student = world.student
    if tied:
        student = save_teacher(
            tmp_path / "tied",
            "llama",
            hidden_size=64,
            seed=13,
            tokenizer=make_tokenizer(),
            tie_word_embeddings=True,
        )
    gen = torch.Generator().manual_seed(5)
    batches = [[torch.randint(0, 200, (2, 9), generator=gen) for _ in range(2 - r)] for r in range(ranks)]
    got = run_distributed(
        _head_gradient, world_size=ranks, args=(backend, str(student), batches), timeout=120
    )[0]

    whole = HFStudent(student, device=torch.device("cpu"), dtype=torch.float32, dp=RankGroup())
    for ids in (ids for rank in batches for ids in rank):
        hidden = whole.hidden_states(ids, torch.ones_like(ids))
        (hidden @ whole.head.T).logsumexp(-1).sum().backward()
    want = {name: p.grad for name, p in whole.model.named_parameters()}
    assert set(got) == {"lm_head.weight", "model.embed_tokens.weight"} & set(want)
    for name, grad in got.items():
        # The same products per microbatch; the ranks' sums add in another order: 3 terms.
        rtol = network_rtol(world.student) + sum_rtol(3)
        assert_close(grad, want[name], rtol=rtol, norm=True, what=name)
    assert len(got) == (1 if tied else 2)
    assert not np.allclose(got["model.embed_tokens.weight" if tied else "lm_head.weight"].numpy(), 0.0)


def _train_live(
    rank: int, world_size: int, world: World, folder: str, options: dict, output: str, stop: int
) -> Any:
    """`_train`, then the trained (live) student's logits over a few rows, before the session closes."""
    from mopd.train.trainer import Trainer

    trainer = Trainer(
        world_config(world, Path(folder) / f"rank{rank}", **options), output=output, log=lambda _l: None
    )
    close, trainer.session.close = trainer.session.close, lambda: None  # keep the shards for the logits
    try:
        result = trainer.run(max_steps=stop)
        with torch.no_grad():
            hidden = trainer.student.hidden_states(PROBE, torch.ones_like(PROBE))
            logits = hidden @ trainer.student.whole_head().T
    finally:
        close()
    return ([r for r in result.records if r.get("split", "train") == "train"], logits) if rank == 0 else None


PROBE = torch.arange(3, 3 + 2 * 11).reshape(2, 11)  # two rows of token ids the export is probed with


def checkpoints(output: Path) -> list[str]:
    """The complete checkpoints' names."""
    return [p.name for p in complete_checkpoints(output / "checkpoints")]


@pytest.mark.slow  # five worlds of 1-3 ranks and an export
def test_sharded_checkpoints_resume_on_any_rank_count_and_export(world: World, tmp_path: Path) -> None:
    """A 6-step run on 2 ranks, checkpoints every 2 steps. Stopped at step 2: resumed on 2 ranks it
    continues bit-exactly; resumed on 3 ranks to step 4, then on 1 to step 6, within trajectory tolerance
    of the uninterrupted run. `export-hf` of its last checkpoint gives the live student's logits."""
    from transformers import AutoModelForCausalLM

    from mopd.train.checkpoint.export import export_hf

    options = {**OPTIONS, "backend": "fsdp", "steps": 6, "checkpoint": {"every": 2, "keep": 3}}
    args = (world, str(tmp_path / "configs"), options)
    whole, live = run_distributed(
        _train_live, world_size=2, args=(*args, str(tmp_path / "whole"), 6), timeout=300
    )[0]
    assert checkpoints(tmp_path / "whole") == ["step_00000002", "step_00000004", "step_00000006"]
    state = tmp_path / "whole" / "checkpoints" / "step_00000006" / "state"
    assert sorted(p.name for p in state.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    for output in ("same", "other"):
        run_distributed(_train, world_size=2, args=(*args, str(tmp_path / output), 2), timeout=300)
    run_distributed(_train, world_size=2, args=(*args, str(tmp_path / "same"), 4), timeout=300)
    assert learned(split(read_metrics(tmp_path / "same" / METRICS_FILE), "train")) == learned(whole[:4])

    run_distributed(_train, world_size=3, args=(*args, str(tmp_path / "other"), 4), timeout=300)
    run_distributed(_train, world_size=1, args=(*args, str(tmp_path / "other"), 6), timeout=300)
    other = split(read_metrics(tmp_path / "other" / METRICS_FILE), "train")
    assert [r["step"] for r in other] == [1, 2, 3, 4, 5, 6]
    assert learned(other[:2]) == learned(whole[:2])
    assert_same_training(other, whole, layers=2, width=128, since=2)

    exported = tmp_path / "exported"
    export_hf(tmp_path / "whole", exported)
    model = AutoModelForCausalLM.from_pretrained(exported)
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    # The same weights and inputs in one process rather than two: products summed in another order.
    assert_close(logits, live, rtol=network_rtol(world.student), norm=True, what="exported logits")


@pytest.mark.slow  # three torchrun launches
def test_a_kill_inside_a_sharded_save_and_a_damaged_shard(world: World, tmp_path: Path) -> None:
    """Both ranks SIGKILLed once they have written their shards of step 4's checkpoint: the run resumes
    from step 2's and ends as an uninterrupted run, bit for bit. Then a shard file changed on disk is
    named when the run resumes again."""
    options = {**OPTIONS, "backend": "fsdp", "steps": 4, "checkpoint": {"every": 2, "keep": 3}}
    world_config(world, tmp_path, **options)
    run = ["train", str(tmp_path / "config.yaml"), "--output", str(tmp_path / "run")]
    run_torchrun(run, nproc=2, env={"MOPD_FAULT": "kill@checkpoint-shards-written:2"}, fails=True)
    assert checkpoints(tmp_path / "run") == ["step_00000002"]
    unfinished = [p for p in (tmp_path / "run" / "checkpoints").iterdir() if is_temporary(p.name)]
    assert [sorted(q.name for q in (p / "state").iterdir()) for p in unfinished] == [
        [".metadata", "__0_0.distcp", "__1_0.distcp"]
    ]  # killed with the shards written, the checkpoint's own files not
    log = run_torchrun(run, nproc=2)
    assert "removed 1 unfinished checkpoint save(s)" in log
    assert "(step 2)" in log
    run_torchrun([*run[:2], "--output", str(tmp_path / "whole")], nproc=2)  # the same launcher, unkilled
    resumed, whole = (read_metrics(tmp_path / name / METRICS_FILE) for name in ("run", "whole"))
    assert learned(resumed) == learned(whole)

    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004"
    verify = ["verify-manifest", str(world.store), "--checkpoint", str(checkpoint)]
    assert CliRunner().invoke(cli, verify).exit_code == 0  # every shard as its marker lists it
    shard = checkpoint / "state" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    damaged = CliRunner().invoke(cli, verify)
    assert damaged.exit_code != 0 and "state/__1_0.distcp: content changed" in damaged.output
    refused = run_torchrun(run, nproc=2, fails=True)
    assert re.search(r"step_00000004 is damaged:\s+\S*/state/__1_0\.distcp: content changed", refused), (
        refused
    )


def _mixed(rank: int, world_size: int, world: World, folder: str, output: str) -> Any:
    """10 steps of fsdp with bf16 mixed precision and activation checkpointing: the records, the dtypes
    of the local shards and AdamW moments, and of a block's weight while it computes."""
    from mopd.train.trainer import Trainer

    options = {**OPTIONS, "backend": "fsdp", "mixed_precision": "bf16", "activation_checkpointing": True}
    config = world_config(world, Path(folder) / f"rank{rank}", **options)
    computing: set[torch.dtype] = set()
    with Trainer(config, output=output, log=lambda _l: None) as trainer:
        q_proj = trainer.student.model.base_model.layers[0].self_attn.q_proj
        q_proj.register_forward_pre_hook(lambda m, _i: computing.add(m.weight.dtype))
        close, trainer.session.close = trainer.session.close, lambda: None
        try:
            records = [r for r in trainer.run().records if r.get("split", "train") == "train"]
            shards = {p.to_local().dtype for p in trainer.student.parameters()}
            moments = {
                s[k].to_local().dtype
                for s in trainer.optimizer.state.values()
                for k in ("exp_avg", "exp_avg_sq")
            }
        finally:
            close()
    return records, shards, moments, computing


def test_fsdp_mixed_precision_keeps_fp32_shards_and_follows_the_fp32_run(
    world: World, tmp_path: Path
) -> None:
    """2 ranks, bf16 mixed precision, activation checkpointing: master shards and AdamW moments fp32,
    blocks computing with bf16 weights, and 10 steps within bf16 rounding of the fp32 run."""
    from tests.train.test_precision import assert_bf16_of

    records, shards, moments, computing = run_distributed(
        _mixed, world_size=2, args=(world, str(tmp_path / "configs"), str(tmp_path / "mixed")), timeout=300
    )[0]
    assert shards == {torch.float32} and moments == {torch.float32}
    assert computing == {torch.bfloat16}
    assert_bf16_of(records, split(reference(world, tmp_path), "train"))


def _shard_shares(rank: int, world_size: int, student: str, replicate: int) -> list[float]:
    """Each parameter's local share of its elements on this rank."""
    from mopd.train.backends.fsdp import FSDPStudent
    from mopd.train.backends.groups import RankGroup

    model = FSDPStudent(
        student,
        device=torch.device("cpu"),
        dtype=torch.float32,
        dp=RankGroup(rank, world_size),
        replicate=replicate,
    )
    return [p.to_local().numel() / p.numel() for p in model.parameters()]


@pytest.mark.parametrize("replicate", [1, 2])
def test_hsdp_shards_within_each_replica(world: World, replicate: int) -> None:
    """4 ranks: with dp_replicate 1 every element of every parameter is on one rank (a quarter of each
    on each), with 2 on two (two replicas of a 2-rank sharding)."""
    shares = run_distributed(_shard_shares, world_size=4, args=(str(world.student), replicate), timeout=120)
    totals = [sum(rank[i] for rank in shares) for i in range(len(shares[0]))]
    assert totals == pytest.approx([float(replicate)] * len(totals))  # every element on `replicate` ranks

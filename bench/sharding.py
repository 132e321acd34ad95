"""What each rank holds of the student, by backend and rank count, on SmolLM2-135M (CPU, gloo, fp32).

For every backend (hf: replicated; fsdp: sharded with FSDP2, its gradients reduce-scattered after
every microbatch or once a step; megatron: TP=1, PP=1, data-parallel replicas whose AdamW state
torch's ZeroRedundancyOptimizer shards), 1, 2 and 4 ranks under torchrun, with and without activation
checkpointing: one warm-up step, then one measured step of the real trainer (two microbatches).
Per rank, after that step:

- parameters, gradients and AdamW state: bytes of the storages of the rank's local tensors (a sharded
  parameter's local shard; every storage counted once),
- the step's peak: resident high-water mark during the step minus the resident size before it (its
  activations, the gradients it allocates, the loss's chunks), and the process's peak RSS. Every
  allocation of 64 KiB or more is its own mapping (MALLOC_MMAP_THRESHOLD_), returned to the system when
  freed, so the resident size follows the live tensors rather than the allocator's free lists.

From the per-parameter bytes of each part of the state measured at the largest rank count, the table
extrapolates the largest student whose state fits one 80 GB GPU at 8 ranks (a part that shrank with
the rank count divides by it, the others stay), leaving `--reserve` GB per GPU for activations,
gathered units and teacher heads.

    python bench/sharding.py [--ranks 1 2 4] [--tokens 2048] [--variants hf fsdp fsdp-step megatron]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from memory import reset_peak, rss_bytes
from smol_store import build_store

GPU_BYTES = 80e9
GPU_RANKS = 8


def storage_bytes(tensors: list[Any]) -> int:
    """Bytes of the storages behind `tensors` (local shards of DTensors), each storage once."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


# The variants: backend and train.parallel.gradient_sync (fsdp only).
VARIANTS = {
    "hf": ("hf", None),
    "fsdp": ("fsdp", "microbatch"),
    "fsdp-step": ("fsdp", "step"),
    "megatron": ("megatron", None),
}


def child(variant: str, recompute: bool, config: Path, output: Path) -> None:
    """One rank's measurement (under torchrun); rank 0 prints every rank's as one JSON line."""
    import torch

    from mopd.config.mopd_config import load_config
    from mopd.train.data.order import LoaderState
    from mopd.train.trainer import Trainer

    loaded = load_config(config)
    assert loaded.train is not None
    backend, sync = VARIANTS[variant]
    # Two microbatches a step on every rank: the gradients accumulate over them as in a real run.
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    tokens = loaded.train.batch.global_batch_tokens
    update: dict[str, Any] = {
        "backend": backend,
        "activation_checkpointing": recompute,
        "batch": loaded.train.batch.model_copy(update={"micro_batch_tokens": tokens // (2 * ranks)}),
    }
    if sync:
        update["parallel"] = loaded.train.parallel.model_copy(update={"gradient_sync": sync})
    loaded = loaded.model_copy(update={"train": loaded.train.model_copy(update=update)})
    trainer = Trainer(loaded, output=output, log=lambda _l: None)
    steps = trainer.loader.steps(LoaderState(0))
    trainer.train_step(1, next(steps))
    batch = next(steps)
    reset_peak()
    before = rss_bytes("VmRSS")
    start = time.perf_counter()
    record = trainer.train_step(2, batch)
    seconds = time.perf_counter() - start
    step_peak = rss_bytes("VmHWM") - before
    params = trainer.student.parameters()
    local = getattr(trainer.optimizer, "optim", trainer.optimizer)  # a ZeRO optimizer's own shard
    state = [v for s in local.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    mine = {
        "parameters": sum(p.numel() for p in params),  # global sizes: the whole student's count
        "param_bytes": storage_bytes(params),
        "grad_bytes": storage_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer_bytes": storage_bytes(state),
        "step_peak_bytes": step_peak,
        "peak_rss_bytes": rss_bytes("VmHWM"),
        "seconds": seconds,
        "loss": record["loss"],
    }
    ranks = trainer.world.all_gather_object(mine)
    steps.close()
    trainer.close()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(ranks))


def measure(variant: str, ranks: int, recompute: bool, config: Path, folder: Path) -> dict[str, Any]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    output = folder / f"run-{variant}-{ranks}-{int(recompute)}"
    command = [*launch, __file__, "--child", variant, str(int(recompute)), str(config), str(output)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks)),
        "MALLOC_MMAP_THRESHOLD_": str(1 << 16),
    }
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"failed": proc.stderr[-1500:]}
    per_rank = json.loads(proc.stdout.strip().splitlines()[-1])
    worst = max(per_rank, key=state_bytes)
    return {**worst, "per_rank": per_rank}


def state_bytes(row: dict[str, Any]) -> int:
    return row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"]


PARTS = ("param_bytes", "grad_bytes", "optimizer_bytes")


def bytes_per_param_at(plain: dict[int, dict[str, Any]], ranks: int) -> dict[str, float]:
    """Each part's bytes per parameter on one rank of `ranks`, from the widest measured run: a part
    that shrank with the rank count (below 3/4 of the one-rank figure) is sharded and scales by
    measured ranks / `ranks`, the others stay."""
    widest, one = plain[max(plain)], plain[min(plain)]
    scaled = {}
    for part in PARTS:
        per_param = widest[part] / widest["parameters"]
        sharded = widest["ranks"] > one["ranks"] and widest[part] < 0.75 * one[part]
        scaled[part] = per_param * widest["ranks"] / ranks if sharded else per_param
    return scaled


def summarise(rows: list[dict[str, Any]], variant: str, reserve: float) -> dict[str, Any] | None:
    """Per-parameter state at the widest run and at 8 ranks, the largest student whose state fits one
    80 GB GPU of 8 (less `reserve` GB), and what recomputation saves of the step's peak, by ranks."""
    done = {(r["ranks"], r["recompute"]): r for r in rows if r["variant"] == variant and "failed" not in r}
    plain = {ranks: r for (ranks, recompute), r in done.items() if not recompute}
    if not plain:
        return None
    widest = plain[max(plain)]
    per_param = state_bytes(widest) / widest["parameters"]
    at_gpu_ranks = bytes_per_param_at(plain, GPU_RANKS)
    return {
        "state_bytes_per_param": per_param,
        "measured_at_ranks": widest["ranks"],
        "bytes_per_param_at_8_ranks": at_gpu_ranks,
        "largest_student_params_8x80GB": (GPU_BYTES - reserve * 1e9) / sum(at_gpu_ranks.values()),
        "step_peak_without_over_with_recompute": {
            ranks: plain[ranks]["step_peak_bytes"] / max(r["step_peak_bytes"], 1)
            for (ranks, recompute), r in done.items()
            if recompute and ranks in plain
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--reserve", type=float, default=20.0, help="GB per GPU kept for all but state")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sharding.json")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, recompute, config, output = args.child
        child(variant, recompute == "1", Path(config), Path(output))
        return

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        config = build_store(folder, args.tokens)
        for variant in args.variants:
            for recompute in (False, True):
                for ranks in args.ranks:
                    result = measure(variant, ranks, recompute, config, folder)
                    rows.append({"variant": variant, "ranks": ranks, "recompute": recompute, **result})
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_rank"}), flush=True)

    gib = 2.0**30
    print(
        f"\nper-rank state (params + grads + AdamW) and step peak, SmolLM2-135M, {args.tokens} tokens a step"
    )
    print(
        f"{'variant':>10}{'ranks':>6}{'recompute':>10}{'state GiB':>10}{'vs 1 rank':>10}{'optimizer':>10}"
        f"{'step peak':>10}{'peak RSS':>9}{'step s':>8}"
    )
    for row in rows:
        where = f"{row['variant']:>10}{row['ranks']:>6}{row['recompute']!s:>10}"
        if "failed" in row:
            print(f"{where}  failed: {row['failed'][-200:]}")
            continue
        one = next(
            (
                r
                for r in rows
                if r["variant"] == row["variant"]
                and r["ranks"] == 1
                and "failed" not in r
                and r["recompute"] == row["recompute"]
            ),
            row,
        )
        row["state_vs_one_rank"] = state_bytes(row) / state_bytes(one)
        row["optimizer_vs_one_rank"] = row["optimizer_bytes"] / one["optimizer_bytes"]
        print(
            f"{where}{state_bytes(row) / gib:10.3f}{row['state_vs_one_rank']:10.3f}"
            f"{row['optimizer_vs_one_rank']:10.3f}{row['step_peak_bytes'] / gib:9.2f}G"
            f"{row['peak_rss_bytes'] / gib:8.2f}G{row['seconds']:8.2f}"
        )
    summary = {}
    for variant in args.variants:
        found = summarise(rows, variant, args.reserve)
        if found is None:
            continue
        summary[variant] = found
        savings = ", ".join(
            f"{k} ranks {v:.1f}x" for k, v in sorted(found["step_peak_without_over_with_recompute"].items())
        )
        print(
            f"{variant}: {found['state_bytes_per_param']:.2f} state bytes/param at "
            f"{found['measured_at_ranks']} ranks, {sum(found['bytes_per_param_at_8_ranks'].values()):.2f} "
            f"at {GPU_RANKS} -> largest student on {GPU_RANKS} x 80 GB "
            f"(reserve {args.reserve:g} GB each): "
            f"{found['largest_student_params_8x80GB'] / 1e9:.1f}B parameters; step peak without / with "
            f"recompute: {savings or '-'}"
        )
    payload = {
        "model": "SmolLM2-135M-Instruct",
        "dtype": "float32",
        "tokens": args.tokens,
        "cpus": os.cpu_count(),
        "reserve_gb": args.reserve,
        "rows": rows,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

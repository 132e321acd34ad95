"""The int8-rotated store against the exact one on the quickstart, priced in nats, in one run.

The quickstart's assets (SmolLM2-135M-Instruct from its wheel, its 16-layer cut, the 4-layer student, the
rows of three agents; `mopd quickstart`'s, under --workdir) and four stores of the same rows:

- tiers: `exact` float32 (the reference), `exact` bfloat16 (the default), `int8-rotated` read back in
  bfloat16 and in float32. For each: bytes per token of the hidden-state shards on disk, precompute
  tokens/s (one job, the teacher forward included) and read tokens/s (`hiddens` of every row, cold
  cache), each with its ratio to the bfloat16 store's; and per token, KL(p‖q) at T = 1 between the teacher
  distribution rebuilt from the float32 store and from the tier, from the logit difference without
  cancellation (`codec.int8_rotated.logit_divergence`): mean, p99, max, and top-1 agreement; with the
  error model's expected mean (`codec.int8_rotated.expected_kl`) beside the int8 tiers' measured one.
- encode and decode: an int8-rotated shard's encode per token against the fp32 store's precompute time
  per token (the fit of each teacher's encoding, a forward of its first 8,192 tokens, is a fixed cost
  per job on top); its read's decode, in the loader (dequantise, un-rotate, add the mean) against folding
  R into the teacher head (dequantise, add the rotated mean: the head becomes W·R), per token, against
  the time per token of a training step of the quickstart.
- distillation: the quickstart's training from the bfloat16 store, from the int8-rotated (bfloat16) store
  and from the float32 store, the same steps; then each student's held-out divergence per teacher on the
  exact bf16 store's held-out rows, against the *exact* teachers, relative to the bf16 store's student.
  The float32 store's student gives the spread that a change of the teacher signal as small as a store's
  rounding makes after these steps. Every arm is trained under --seeds `train.seed`s (another data order
  and other held-out rows); each arm's relative difference is reported per seed and as a mean with its
  standard error, telling a bias from the seeds' spread. --lr trains at another learning rate;
  --distillation-only trains from the stores a full run left in --workdir.

    python bench/lossy.py [--workdir DIR] [--rows-per-agent 48] [--steps 100] [--seeds 3] [--lr LR]
                          [--distillation-only] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mopd.cli.quickstart import FULL, Size, quickstart_config  # noqa: E402
from mopd.cli.quickstart_assets import prepare_models, write_dataset  # noqa: E402
from mopd.config.mopd_config import load_config  # noqa: E402
from mopd.precompute.runner import run_precompute  # noqa: E402
from mopd.store import open_store  # noqa: E402
from mopd.store.codec.int8_rotated import expected_kl, logit_divergence  # noqa: E402
from mopd.store.format.transform import LogitTransform  # noqa: E402
from mopd.store.reader import TeacherStore  # noqa: E402
from mopd.train.checkpoint.resume import init_checkpoint  # noqa: E402
from mopd.train.checkpoint.state import complete_checkpoints, load_weights  # noqa: E402
from mopd.train.session import open_session  # noqa: E402
from mopd.train.trainer import held_out_rows, run_training  # noqa: E402

TIERS = {  # name → (store.encoding, store.dtype)
    "exact_fp32": ("exact", "float32"),
    "exact_bf16": ("exact", "bfloat16"),
    "int8_bf16": ("int8-rotated", "bfloat16"),
    "int8_fp32": ("int8-rotated", "float32"),
}
BASELINE = "exact_bf16"
QUIET = {"log": lambda *_: None}


def tier_config(workdir: Path, size: Size, tier: str, steps: int, lr: float | None) -> Path:
    encoding, dtype = TIERS[tier]
    raw = quickstart_config(size)
    if lr is not None:
        raw["train"]["optim"]["lr"] = lr
    raw["store"] = {"path": f"{tier}.zarr", "dtype": dtype, "encoding": encoding}
    raw["precompute"]["dtype"] = "float32"  # the reference is the fp32 teacher
    raw["train"]["steps"] = steps
    raw["train"]["eval"]["every"] = 0
    raw["train"]["checkpoint"]["every"] = steps
    raw["train"]["output_dir"] = f"{tier}-run"
    path = workdir / f"{tier}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def shard_bytes_per_token(store: TeacherStore) -> float:
    shards = store.manifest.shards
    return sum(s.bytes for s in shards) / sum(s.tokens for s in shards)


def read_throughput(store: TeacherStore) -> float:
    store.cache.clear()
    rows = np.arange(store.num_rows)
    start = time.perf_counter()
    states = store.hiddens(rows)
    return sum(s.shape[0] for s in states) / (time.perf_counter() - start)


def divergence(reference: TeacherStore, tier: TeacherStore) -> dict[str, Any]:
    """Per token, KL(p‖q) of the tier's teacher distribution from the fp32 store's, and the error
    model's expectation for an encoded tier."""
    kl, agree, model = [], [], []
    rows = np.arange(reference.num_rows)
    teacher_of = reference.teacher_indices
    for teacher in reference.teachers:
        head = reference.lm_head(teacher.index).float()
        transform = LogitTransform(teacher.logit_scale, teacher.final_logit_softcap)
        mine = rows[teacher_of == teacher.index]
        exact = torch.cat(reference.hiddens(mine)).float()
        approx = torch.cat(tier.hiddens(mine)).float()
        coded = tier.encoding(teacher.index)
        for h, g in zip(exact.split(256), approx.split(256), strict=True):
            logits = h @ head.T
            token_kl, token_agree = logit_divergence(logits, (h - g) @ head.T, transform)
            kl.append(token_kl)
            agree.append(token_agree)
            if coded is not None:
                _, scales = coded[0].encode(h)
                model.append(expected_kl(torch.softmax(logits.double(), dim=-1), head, scales))
    kls = torch.cat(kl)
    out = {
        "tokens": int(kls.shape[0]),
        "kl_mean": float(kls.mean()),
        "kl_p99": float(torch.quantile(kls, 0.99)),
        "kl_max": float(kls.max()),
        "top1_agreement": float(torch.cat(agree).double().mean()),
    }
    if model:
        out["kl_mean_error_model"] = float(torch.cat(model).mean())
    return out


def decode_costs(store: TeacherStore, repeats: int = 5) -> dict[str, float]:
    """Seconds per token of an int8-rotated shard's encode, and of its decode: in the loader, and with R
    folded into the head."""
    teacher = store.teachers[0].index
    encoding = store.encoding(teacher)
    assert encoding is not None
    rows = np.flatnonzero(store.teacher_indices == teacher)
    exact = torch.cat(open_store(store.root).hiddens(rows)).float()
    codes, scales = encoding[0].encode(exact)
    rotated_mean = encoding[0].rotate(encoding[0].mean[None])[0]

    def best(fn: Any) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times) / codes.shape[0]

    return {
        "tokens": int(codes.shape[0]),
        "encode_s_per_token": best(lambda: encoding[0].encode(exact)),
        "loader_s_per_token": best(lambda: encoding[0].decode(codes, scales)),
        "folded_s_per_token": best(lambda: codes.float() * scales[:, None] + rotated_mean),
    }


DISTILLED = (BASELINE, "int8_bf16", "exact_fp32")  # the fp32 store: a change as small as storage gets


def distil(workdir: Path, configs: dict[str, Path], seeds: int) -> dict[str, Any]:
    """Trains the quickstart's student from each of DISTILLED's stores under each `train.seed` in
    0..seeds-1 (another data order and other held-out rows); each final student's held-out divergence per
    teacher against the exact bf16 store's teachers, its relative difference from the bf16 store's
    student of the same seed, and per tier the mean and standard error of those differences."""
    by_seed: dict[str, dict[str, Any]] = {}
    for seed in range(seeds):
        by_seed[str(seed)] = {tier: distil_one(workdir, configs[tier], tier, seed) for tier in DISTILLED}
    return {"by_seed": by_seed, "relative_difference_by_teacher": relative_differences(by_seed)}


def relative_differences(by_seed: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Sets each arm's held-out divergence relative to the bf16 store's arm of its seed; per arm other
    than that one and per teacher, the mean of those differences over the seeds that trained the arm
    and its standard error."""
    for arms in by_seed.values():
        base = arms[BASELINE]["heldout_divergence_by_teacher"]
        for arm in arms.values():
            mine = arm["heldout_divergence_by_teacher"]
            arm["relative_difference_by_teacher"] = {t: mine[t] / base[t] - 1 for t in base}
    summary: dict[str, Any] = {}
    for tier in DISTILLED[1:]:
        trained = [by_seed[s][tier]["relative_difference_by_teacher"] for s in by_seed if tier in by_seed[s]]
        differences = np.array([list(d.values()) for d in trained])
        teachers = list(trained[0])
        n = len(trained)
        spread = differences.std(axis=0, ddof=1) / np.sqrt(n) if n > 1 else [None] * len(teachers)
        summary[tier] = {  # one seed has no standard error: null
            t: {"seeds": n, "mean": float(m), "standard_error": None if e is None else float(e)}
            for t, m, e in zip(teachers, differences.mean(axis=0), spread, strict=True)
        }
    return summary


def distil_one(workdir: Path, config_path: Path, tier: str, seed: int) -> dict[str, Any]:
    """One training of the quickstart's student from `tier`'s store under `train.seed` = `seed`; the final
    student's held-out divergence per teacher on the exact bf16 store."""
    raw = yaml.safe_load(config_path.read_text())
    raw["train"]["seed"] = seed
    raw["train"]["output_dir"] = f"{tier}-seed{seed}-run"
    seeded = workdir / f"{tier}-seed{seed}.yaml"
    seeded.write_text(yaml.safe_dump(raw, sort_keys=False))
    config = load_config(seeded)
    start = time.perf_counter()
    result = run_training(config, resume=False, **QUIET)
    train_s = time.perf_counter() - start
    steps = [r for r in result.records if r.get("split", "train") == "train"]
    raw["train"]["init_from"] = {"checkpoint": str(complete_checkpoints(result.output / "checkpoints")[-1])}
    evaluated = workdir / f"{tier}-seed{seed}-heldout.yaml"
    evaluated.write_text(yaml.safe_dump(raw, sort_keys=False))
    exact_store = workdir / f"{BASELINE}.zarr"
    held = held_out_rows(open_store(exact_store).num_rows, raw["train"]["eval"]["rows"], seed)
    print(tier, "seed", seed, f"trained in {train_s:.0f} s", flush=True)
    return {
        "steps": len(steps),
        "train_s": train_s,
        "train_tokens_per_s": sum(r["tokens"] for r in steps) / train_s,
        "heldout_divergence_by_teacher": held_out_divergence(load_config(evaluated), exact_store, held),
    }


def held_out_divergence(config: Any, store: Path, rows: np.ndarray) -> dict[str, float]:
    """The divergence per teacher of `config`'s `train.init_from` student over `rows` of `store`."""
    with open_session(config, store_path=store, **QUIET) as session:
        init = session.config.init_from
        assert init is not None
        found = init_checkpoint(init, layout=session.student.layout, world=session.world)
        load_weights(found.folder, found.state, session.student, None, hyper_parameters=False)
        return dict(session.evaluate(rows, step=0)["divergence_by_teacher"])


def measure_tiers(workdir: Path, configs: dict[str, Path]) -> dict[str, Any]:
    """Each tier's store made by one job: bytes, precompute and read speeds, and the KL from the fp32
    store's teacher distributions."""
    tiers: dict[str, Any] = {}
    for tier, config in configs.items():
        result = run_precompute(load_config(config), show_progress=False, **QUIET)
        store = open_store(result.store)
        tiers[tier] = {
            "bytes_per_token": shard_bytes_per_token(store),
            "precompute_tokens_per_s": result.tokens_per_s,
            "read_tokens_per_s": read_throughput(store),
        }
        print(tier, json.dumps(tiers[tier]), flush=True)
    reference = open_store(workdir / "exact_fp32.zarr")
    for tier in TIERS:
        if tier != "exact_fp32":
            tiers[tier]["vs_exact_fp32"] = divergence(reference, open_store(workdir / f"{tier}.zarr"))
        for key in ("bytes_per_token", "precompute_tokens_per_s", "read_tokens_per_s"):
            tiers[tier][f"{key}_ratio"] = tiers[tier][key] / tiers[BASELINE][key]
        print(tier, json.dumps(tiers[tier]), flush=True)
    return tiers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=REPO.parent / "mopd-lossy")
    parser.add_argument("--rows-per-agent", type=int, default=FULL.rows_per_agent)
    parser.add_argument("--steps", type=int, default=FULL.steps)
    parser.add_argument("--eval-rows", type=int, default=FULL.eval_rows, help="held-out rows")
    parser.add_argument("--seeds", type=int, default=3, help="train.seed 0..N-1 for every distilled arm")
    parser.add_argument("--lr", type=float, default=None, help="train.optim.lr (default: the quickstart's)")
    parser.add_argument(
        "--distillation-only", action="store_true", help="train from the stores a full run left in --workdir"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "lossy.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    size = Size("quickstart", args.rows_per_agent, args.steps, args.eval_rows, 0, FULL.global_batch_tokens)
    if not args.distillation_only:
        prepare_models(workdir, lambda *_: None)
        write_dataset(workdir / f"{size.name}.jsonl", size.rows_per_agent)
    os.chdir(workdir)  # the quickstart's paths are relative to its folder
    configs = {tier: tier_config(workdir, size, tier, args.steps, args.lr) for tier in TIERS}
    payload: dict[str, Any] = {
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "rows_per_agent": args.rows_per_agent,
        "steps": args.steps,
        "lr": load_config(configs[BASELINE]).train.optim.lr,
        "seeds": args.seeds,
    }
    if not args.distillation_only:
        payload["tiers"] = measure_tiers(workdir, configs)
        payload["decode"] = decode_costs(open_store(workdir / "int8_bf16.zarr"))
    payload["distillation"] = distillation = distil(workdir, configs, args.seeds)
    print("distillation", json.dumps(distillation), flush=True)
    if not args.distillation_only:
        decode, tiers = payload["decode"], payload["tiers"]
        step_s_per_token = 1 / distillation["by_seed"]["0"][BASELINE]["train_tokens_per_s"]
        decode["loader_share_of_step"] = decode["loader_s_per_token"] / step_s_per_token
        decode["folded_share_of_step"] = decode["folded_s_per_token"] / step_s_per_token
        forward_s_per_token = 1 / tiers["exact_fp32"]["precompute_tokens_per_s"]
        decode["encode_share_of_precompute"] = decode["encode_s_per_token"] / forward_s_per_token
        print("decode", json.dumps(decode), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()

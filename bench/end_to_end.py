"""What the offline store buys: one training step of the same student on the same tokens, three ways.

- **store**: the teacher's hidden states read from a mopd store (the rows' bytes decoded per step) and
  its LM head, then the fused divergence (`linear_divergence`): what `mopd train` does.
- **live, hidden-state style**: the teacher runs forward every step (no grad) and its final hidden
  states and head go to the same fused divergence: online distillation done as well as it can be.
- **live, logits style**: the teacher runs forward and its full [N, V] logits are materialised, the
  student's too, and the reverse KL is taken over them in eager torch: how RL frameworks score a
  student against a live teacher.

Teacher: SmolLM2-135M (the packaged checkpoint, 30 blocks). Student: the quickstart's (its first 4
blocks). Tokens: the quickstart's dataset, the same rows in every variant. fp32 compute, bf16 store, on
this machine's CPU. Each variant runs in a fresh process; its peak is the resident high-water mark
during the timed steps above the resident size before them.

The break-even: precompute costs `precompute_s / tokens` once (the teacher's forward over every row,
writing the store, model loading included); each pass over the data then saves
`1 / tokens_per_s(live) − 1 / tokens_per_s(store)` a token. After `break_even_passes` passes the store
has paid for itself.

    python bench/end_to_end.py            # ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO.parent))
sys.path.insert(0, str(REPO / "bench"))

from memory import reset_peak, rss_bytes  # noqa: E402

VARIANTS = ("store", "live-hidden", "live-logits")


def build(work: Path, rows_per_agent: int) -> dict[str, Any]:
    """The models, the dataset and the store (timed: the one-time cost the store-fed run pays)."""
    from mopd.cli.quickstart_assets import BIG_TEACHER, STUDENT, prepare_models, write_dataset

    models = prepare_models(work, log=lambda _line: None)
    data = write_dataset(work / "data.jsonl", rows_per_agent)
    config = work / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "teachers": {"teacher": str(models[BIG_TEACHER])},
                "routing": {"default_teacher": "teacher"},
                "data": {"path": str(data), "max_length": 160},
                "store": {"path": str(work / "store.zarr"), "dtype": "bfloat16"},
                "precompute": {"batch_tokens": 4096, "rows_per_task": 4096},
            }
        )
    )
    mopd = shutil.which("mopd") or str(Path(sys.executable).parent / "mopd")
    start = time.perf_counter()
    proc = subprocess.run([mopd, "precompute", str(config)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"mopd precompute failed:\n{proc.stderr[-3000:]}")
    precompute_s = time.perf_counter() - start
    from mopd.store import open_store

    store = open_store(work / "store.zarr")
    return {
        "teacher": str(models[BIG_TEACHER]),
        "student": str(models[STUDENT]),
        "store": str(work / "store.zarr"),
        "precompute_s": precompute_s,
        "store_tokens": int(store.lengths.sum()),
    }


def batches(store_path: str, tokens_per_step: int, steps: int) -> list[np.ndarray]:
    """Row indices of each step: consecutive rows up to `tokens_per_step` tokens, different per step."""
    from mopd.store import open_store

    lengths = open_store(store_path).lengths
    out, at = [], 0
    for _ in range(steps):
        rows, tokens = [], 0
        while tokens + int(lengths[at % lengths.size]) <= tokens_per_step:
            rows.append(at % lengths.size)
            tokens += int(lengths[at % lengths.size])
            at += 1
        out.append(np.array(rows))
    return out


def padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] input ids (0-padded) and the mask of real tokens."""
    width = max(r.shape[0] for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : r.shape[0]], mask[i, : r.shape[0]] = r, True
    return ids, mask


def child(variant: str, spec: dict[str, Any], tokens_per_step: int, steps: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from mopd.store import open_store
    from mopd.train.kernel.chunk_chain import chunk_size_for
    from mopd.train.kernel.divergence import linear_divergence

    torch.manual_seed(0)
    store = open_store(spec["store"])
    student = AutoModelForCausalLM.from_pretrained(spec["student"], torch_dtype=torch.float32)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-5)
    teacher = None
    if variant != "store":
        teacher = AutoModelForCausalLM.from_pretrained(spec["teacher"], torch_dtype=torch.float32).eval()
    head = store.lm_head(0) if variant == "store" else None
    chunk = chunk_size_for("auto", torch.device("cpu"))  # what `mopd train` uses here
    plan = batches(spec["store"], tokens_per_step, steps + 1)

    def step(rows: np.ndarray) -> int:
        ids, mask = padded([r.input_ids for r in store.rows(rows)])
        hidden_s = student.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state[mask]
        head_s = student.get_output_embeddings().weight
        if variant == "store":
            hidden_t = torch.cat(store.hiddens(rows))
            loss = linear_divergence(hidden_s, head_s, hidden_t, {0: head}, None, chunk_size=chunk).loss
        elif variant == "live-hidden":
            assert teacher is not None
            with torch.no_grad():
                hidden_t = teacher.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state[mask]
            head_t = teacher.get_output_embeddings().weight.detach()
            loss = linear_divergence(hidden_s, head_s, hidden_t, {0: head_t}, None, chunk_size=chunk).loss
        else:
            assert teacher is not None
            with torch.no_grad():
                logits_t = teacher(input_ids=ids, attention_mask=mask.long()).logits[mask]
            logits_s = student.get_output_embeddings()(hidden_s)
            logp_s, logp_t = logits_s.log_softmax(-1), logits_t.log_softmax(-1)
            loss = (logp_s.exp() * (logp_s - logp_t)).sum(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return int(mask.sum())

    step(plan[0])  # warm-up: first-call allocations, lazy initialisation
    reset_peak()
    before = rss_bytes("VmRSS")
    seconds, tokens = [], 0
    for rows in plan[1:]:
        start = time.perf_counter()
        tokens += step(rows)
        seconds.append(time.perf_counter() - start)
    return {
        "step_s": float(np.median(seconds)),
        "tokens_per_step": tokens / steps,
        "tokens_per_s": tokens / sum(seconds),
        "peak_gb": (rss_bytes("VmHWM") - before) / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows-per-agent", type=int, default=200, help="dataset size (3 agents)")
    parser.add_argument("--tokens-per-step", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "end_to_end.json")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, spec = args.child
        result = child(variant, json.loads(spec), args.tokens_per_step, args.steps)
        print(json.dumps(result))
        return
    work = Path(tempfile.mkdtemp(prefix="mopd-e2e-"))
    try:
        spec = build(work, args.rows_per_agent)
        print(f"precompute: {spec['store_tokens']:,} tokens in {spec['precompute_s']:.1f} s", flush=True)
        results: dict[str, Any] = {}
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--child", variant, json.dumps(spec)]
            cmd += ["--tokens-per-step", str(args.tokens_per_step), "--steps", str(args.steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(variant, results[variant], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    precompute_per_token = spec["precompute_s"] / spec["store_tokens"]
    summary = {}
    for live in ("live-hidden", "live-logits"):
        saved = 1 / results[live]["tokens_per_s"] - 1 / results["store"]["tokens_per_s"]
        summary[live] = {
            "store_speedup": results["store"]["tokens_per_s"] / results[live]["tokens_per_s"],
            "break_even_passes": precompute_per_token / saved if saved > 0 else None,
        }
    payload = {
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "precompute_s": spec["precompute_s"],
        "store_tokens": spec["store_tokens"],
        "precompute_tokens_per_s": spec["store_tokens"] / spec["precompute_s"],
        "variants": results,
        "against_store": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"{'':14}{'tokens/s':>10}{'step s':>9}{'peak GB':>9}")
    for variant, r in results.items():
        print(f"{variant:14}{r['tokens_per_s']:10.0f}{r['step_s']:9.2f}{r['peak_gb']:9.2f}")
    for live, s in summary.items():
        passes = "never" if s["break_even_passes"] is None else f"{s['break_even_passes']:.2f} passes"
        print(f"store vs {live}: {s['store_speedup']:.2f}x tokens/s; the store pays off after {passes}")


if __name__ == "__main__":
    main()

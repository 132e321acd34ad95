"""What a teacher fingerprint costs: `checkpoint_fingerprint` (every weight file, sha256 on parallel
threads) against one thread hashing the same bytes and against reading them, in one run.

A synthetic checkpoint of `--gib` GiB in `--shards` safetensors files (random bytes: sha256's speed does
not depend on content). Each measurement starts from the page cache the previous one left, the way a
precompute job fingerprints the checkpoint it is about to load. Prints a table and writes
bench/results/fingerprint.json.

    python bench/fingerprint.py [--gib 2] [--shards 4]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from mopd.store.format import fingerprint


def make_checkpoint(folder: Path, gib: float, shards: int) -> int:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1}))
    per_shard = int(gib * 2**30 / shards) // 4
    rng = np.random.default_rng(0)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensor = torch.from_numpy(rng.integers(0, 2**31, per_shard, dtype=np.int32).view(np.float32).copy())
        save_file({f"layer.{s}.weight": tensor}, folder / name, metadata={"format": "pt"})
        weight_map[f"layer.{s}.weight"] = name
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def one_thread(folder: Path) -> None:
    for path in sorted(folder.glob("*.safetensors")):
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)


def read_only(folder: Path) -> None:
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            while f.read(1 << 24):
                pass


def timed(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fingerprint.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mopd-bench-fingerprint-"))
    try:
        size = make_checkpoint(work / "ckpt", args.gib, args.shards)
        times: dict[str, list[float]] = {"read": [], "sha256_one_thread": [], "fingerprint": []}
        for _ in range(args.repeats):  # interleaved, best of each
            times["read"].append(timed(read_only, work / "ckpt"))
            times["sha256_one_thread"].append(timed(one_thread, work / "ckpt"))
            fingerprint._cached_sha256.cache_clear()  # the job-level cache would make repeats free
            times["fingerprint"].append(timed(fingerprint.checkpoint_fingerprint, work / "ckpt"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    best = {k: min(v) for k, v in times.items()}
    result = {
        "bytes": size,
        "shards": args.shards,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "all_seconds": times,
        "gb_per_s": {k: size / s / 1e9 for k, s in best.items()},
        "fingerprint_vs_one_thread": best["sha256_one_thread"] / best["fingerprint"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{size / 2**30:.2f} GiB in {args.shards} safetensors files, {os.cpu_count()} cores")
    for name, seconds in best.items():
        print(f"{name:20}{seconds:8.2f} s{size / seconds / 1e9:8.2f} GB/s")
    print(f"fingerprint is {result['fingerprint_vs_one_thread']:.2f}x one thread's sha256; wrote {args.out}")


if __name__ == "__main__":
    main()

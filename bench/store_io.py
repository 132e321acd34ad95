"""Store I/O against the raw disk, measured in one run (DESIGN §4, §10).

Writes a ragged bf16 payload ([262144, 2048] by default: 1 GiB) through the store's public writer
(mopd's streaming shard writer: inner-chunk encoding, fsync, publish, hashing, part records included),
reads it back row by row through `open_store(...).hidden(i)`, and compares with the same bytes written
to one raw file with fsync and read back. The same payload is also written by zarr-python into the same
sharded layout, the general-purpose engine, and through the store without per-chunk checksums, which
prices the crc32c that every read verifies. The store is also read without binding its files to their
part records (as format 3 read it: each chunk checked by its own crc32c only), in warm adjacent pairs
with the bound read, which prices the binding (a recorded size and zarr.json hash per array, one list of
chunk checksums per shard, 4 bytes compared per chunk). Prints a table and writes bench/results/store_io.json.

The payload imitates final-norm hidden states: N(0, 1) values times a per-channel scale drawn from
lognormal(0, 0.5) (the norm's weight), rounded to bf16.

    python bench/store_io.py [--tokens 262144] [--hidden 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec

from mopd.base.fsio import fsync_tree
from mopd.precompute.plan import CHUNK_BYTES
from mopd.store import open_store
from mopd.store.arrays.binding import Recorded
from mopd.store.arrays.write import storage_dtype
from mopd.store.format.layout import plan_tasks, shard_rows
from mopd.store.format.manifest import (
    DatasetInfo,
    Plan,
    ShardTask,
    StorageInfo,
    StoreSettings,
    TeacherInfo,
    TokenizerInfo,
)
from mopd.store.reader import TeacherStore
from mopd.store.task_writers import HiddenShardWriter, write_lm_head, write_rows
from mopd.store.writer import StoreWriter


def ragged_lengths(total: int, rng: np.random.Generator) -> list[int]:
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(int(rng.integers(1, 4097)), total - sum(lengths)))
    return lengths


def payload(tokens: int, hidden: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    scale = torch.empty(hidden).log_normal_(0.0, 0.5, generator=generator)
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    for start in range(0, tokens, 16384):  # bounded fp32 temporaries
        block = torch.randn(min(16384, tokens - start), hidden, generator=generator)
        out[start : start + block.shape[0]] = (block * scale).to(torch.bfloat16)
    return out


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def raw_write(path: Path, data: np.ndarray) -> float:
    start = time.perf_counter()
    with path.open("wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def raw_read(path: Path) -> float:
    start = time.perf_counter()
    with path.open("rb") as f:
        while f.read(64 << 20):
            pass
    return time.perf_counter() - start


def store_write(
    root: Path, hidden: torch.Tensor, lengths: list[int], rows_per_task: int, *, checksum: bool = True
) -> float:
    num_rows, hidden_size = len(lengths), hidden.shape[1]
    teacher_index = np.zeros(num_rows, dtype=np.int64)
    plan = Plan(
        tokenizer=TokenizerInfo(name="bench", vocab_hash="bench", vocab_size=1024),
        dataset=DatasetInfo(source="bench", fingerprint="bench", num_rows=num_rows, num_tokens=sum(lengths)),
        teachers=[
            TeacherInfo(index=0, checkpoint="bench", aliases=["bench"], fingerprint="bench", backend="bench")
        ],
        tasks=plan_tasks(teacher_index, num_teachers=1, rows_per_task=rows_per_task),
        storage=StorageInfo(
            hidden_dtype="bfloat16",
            codec="shuffle-zstd1",
            chunk_bytes=CHUNK_BYTES,
            checksum="crc32c" if checksum else None,
        ),
        config=StoreSettings(),
    )
    writer = StoreWriter.open(root, plan)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    with writer.task("rows") as out:
        write_rows(
            out,
            input_ids=[np.zeros(int(offsets[-1]), np.int32)],
            loss_mask=[np.ones(int(offsets[-1]), np.uint8)],
            offsets=offsets,
            teacher_index=teacher_index,
            source_keys=[str(i) for i in range(num_rows)],
        )
    with writer.task("teacher_000_lm_head") as out:
        write_lm_head(out, torch.zeros(1024, hidden_size, dtype=torch.bfloat16))
    start = time.perf_counter()
    for task in plan.tasks:
        if not isinstance(task, ShardTask):
            continue
        rows = shard_rows(teacher_index, task)
        with writer.task(task.task_id) as out:
            shard = HiddenShardWriter(
                out, row_ids=rows, lengths=np.array(lengths)[rows], hidden_size=hidden_size, dtype="bfloat16"
            )
            for row in rows:
                shard.append(int(row), hidden[offsets[row] : offsets[row + 1]])
            shard.close()
    elapsed = time.perf_counter() - start
    writer.finalize(created_by="bench", volatile={})
    return elapsed


class UnboundStore(TeacherStore):
    """The store read without its part records: every chunk checked by its own crc32c only."""

    def _recorded(self, folder: str, name: str) -> Recorded | None:
        return None


def store_read(root: Path, *, bound: bool = True) -> tuple[float, bool]:
    store = open_store(root) if bound else UnboundStore(root)
    start = time.perf_counter()
    for i in range(store.num_rows):
        store.hidden(i)
    return time.perf_counter() - start, True


def binding_pairs(root: Path, pairs: int) -> dict[str, list[float]]:
    """Seconds of whole reads of the store with and without binding, in adjacent pairs (alternating
    which goes first) from a warm page cache: the binding adds CPU work only, which a cold read's disk
    time would hide in its noise. Their ratio is taken pair by pair, so that drift cancels."""
    times: dict[str, list[float]] = {"bound": [], "unbound": []}
    for pair in range(pairs):
        for bound in (True, False) if pair % 2 == 0 else (False, True):
            times["bound" if bound else "unbound"].append(store_read(root, bound=bound)[0])
    return times


def zarr_python_write(path: Path, data: np.ndarray) -> float:
    start = time.perf_counter()
    rows_per_chunk = CHUNK_BYTES // (data.shape[1] * data.itemsize)
    array = zarr.create_array(
        path,
        shape=data.shape,
        chunks=(rows_per_chunk, data.shape[1]),
        shards=(rows_per_chunk * -(-data.shape[0] // rows_per_chunk), data.shape[1]),
        dtype="uint16",
        compressors=[BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", typesize=2, blocksize=1 << 20)],
    )
    array[:] = data
    fsync_tree(path)
    return time.perf_counter() - start


def stored_bytes(root: Path, under: str) -> int:
    return sum(p.stat().st_size for p in (root / under).rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=262144)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rows-per-task", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--binding-pairs", type=int, default=15)
    parser.add_argument("--workdir", type=Path, default=None, help="folder on the disk to measure")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "store_io.json")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    lengths = ragged_lengths(args.tokens, rng)
    hidden = payload(args.tokens, args.hidden)
    data = hidden.view(torch.int16).numpy().view(storage_dtype("bfloat16"))
    logical = data.nbytes
    work = Path(tempfile.mkdtemp(prefix="mopd-bench-", dir=args.workdir))
    keys = ("raw_w", "raw_r", "store_w", "store_r", "zarr_w", "plain_w", "plain_r")
    times: dict[str, list[float]] = {k: [] for k in keys}
    cold = False
    try:
        # Interleaved repeats, best of each: the disk's speed drifts during a run (writeback, other I/O).
        for rep in range(args.repeats):
            raw_path = work / "raw.bin"
            times["raw_w"].append(raw_write(raw_path, data))
            cold = drop_page_cache()
            times["raw_r"].append(raw_read(raw_path))
            raw_path.unlink()
            store_root = work / f"store-{rep}.zarr"
            times["store_w"].append(store_write(store_root, hidden, lengths, args.rows_per_task))
            drop_page_cache()
            times["store_r"].append(store_read(store_root)[0])
            if rep == args.repeats - 1:
                binding = binding_pairs(store_root, args.binding_pairs)
            on_disk = stored_bytes(store_root, "teachers/0/shards")
            shutil.rmtree(store_root)
            plain_root = work / f"plain-{rep}.zarr"
            times["plain_w"].append(
                store_write(plain_root, hidden, lengths, args.rows_per_task, checksum=False)
            )
            drop_page_cache()
            times["plain_r"].append(store_read(plain_root)[0])
            shutil.rmtree(plain_root)
            times["zarr_w"].append(zarr_python_write(work / f"zarr-python-{rep}.zarr", data))
            shutil.rmtree(work / f"zarr-python-{rep}.zarr")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    raw_write_s, raw_read_s, store_write_s, store_read_s, zarr_write_s, plain_write_s, plain_read_s = (
        min(times[k]) for k in keys
    )
    binding_cost = float(np.median(np.array(binding["bound"]) / np.array(binding["unbound"]))) - 1

    gbs = lambda seconds: logical / seconds / 1e9  # noqa: E731
    result = {
        "payload": {
            "tokens": args.tokens,
            "hidden": args.hidden,
            "rows": len(lengths),
            "dtype": "bfloat16",
            "logical_bytes": logical,
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "page_cache_dropped_before_reads": cold,
        "repeats": args.repeats,
        "all_seconds": times,
        "raw": {"write_s": raw_write_s, "read_s": raw_read_s},
        "store": {
            "write_s": store_write_s,
            "read_s": store_read_s,
            "bytes_on_disk": on_disk,
            "engine": "mopd shard writer",
            "inner_chunk_bytes": CHUNK_BYTES,
            "codec": "blosc(zstd, clevel 1, byte-shuffle, 1 MiB blocks)",
        },
        "zarr_python_engine": {"write_s": zarr_write_s},
        "ratios": {
            "store_write_vs_raw": raw_write_s / store_write_s,
            "store_read_vs_raw": raw_read_s / store_read_s,
            "compressed_over_raw_bytes": on_disk / logical,
            "compression_ratio": logical / on_disk,
            "store_vs_zarr_python_write": zarr_write_s / store_write_s,
            "checksum_read_cost": store_read_s / plain_read_s - 1,
            "checksum_write_cost": store_write_s / plain_write_s - 1,
            "binding_read_cost": binding_cost,
        },
        "binding_pairs_warm_s": binding,
        "store_without_checksums": {"write_s": plain_write_s, "read_s": plain_read_s},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"payload: {len(lengths)} ragged rows, {args.tokens} x {args.hidden} bf16 = {logical / 2**30:.2f} GiB"
    )
    print(f"{'':28}{'seconds':>10}{'GB/s':>8}{'vs raw':>9}")
    for name, seconds, base in [
        ("raw write + fsync", raw_write_s, raw_write_s),
        ("store write (shard writer)", store_write_s, raw_write_s),
        ("  without checksums", plain_write_s, raw_write_s),
        ("zarr-python write", zarr_write_s, raw_write_s),
        ("raw read", raw_read_s, raw_read_s),
        ("store read (hidden(i))", store_read_s, raw_read_s),
        ("  without checksums", plain_read_s, raw_read_s),
    ]:
        print(f"{name:28}{seconds:10.2f}{gbs(seconds):8.2f}{base / seconds:8.2f}x")
    print(
        f"on disk: {on_disk / logical:.3f} x raw bytes (compression {logical / on_disk:.3f}x); "
        f"page cache dropped before reads: {cold}"
    )
    print(
        f"crc32c checksums cost {result['ratios']['checksum_read_cost']:+.1%} of read time and "
        f"{result['ratios']['checksum_write_cost']:+.1%} of write time"
    )
    print(
        f"binding files to their part records costs {result['ratios']['binding_read_cost']:+.1%} of read time"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Acceptance: ragged rows of several teachers read back bit-exact; LM-head slices read only their chunks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from mopd.store import StoreIntegrityError, open_store
from mopd.store.arrays.read import ArrayReader
from tests.store.synthetic import VOCAB_SIZE, StoreSpec, build_store, head_for, hidden_for, tokens_for
from tests.tolerance import assert_close


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_ragged_rows_round_trip_bit_exact(small_spec: StoreSpec, dtype: str) -> None:
    rng = np.random.default_rng(0)
    num_rows = 24
    lengths = [1, 4096, *rng.integers(1, 4097, size=num_rows - 2).tolist()]
    agents = [["math", "code", "chat", "reasoning"][i % 4] for i in range(num_rows)]
    spec = dataclasses.replace(
        small_spec, lengths=lengths, agents=agents, dtype=dtype, rows_per_task=5, chunk_bytes=1 << 18
    )
    build_store(spec)
    store = open_store(spec.root)
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    assert store.num_rows == num_rows
    assert store.manifest.dataset.num_tokens == sum(lengths)
    aliases = {t.index: t.aliases for t in store.manifest.teachers}
    assert sorted(map(tuple, aliases.values())) == [("chat",), ("code",), ("math", "reasoning")]
    seen_teachers = set()
    for i, (length, agent) in enumerate(zip(lengths, agents, strict=True)):
        row = store.row(i)
        assert agent in aliases[row.teacher_index]
        seen_teachers.add(row.teacher_index)
        assert torch.equal(row.input_ids, torch.from_numpy(tokens_for(i, length)))
        assert torch.equal(row.loss_mask, torch.from_numpy(np.arange(length) % 3 != 0))
        hidden = store.hidden(i)
        teacher = store.teacher(row.teacher_index)
        expected = hidden_for(i, row.teacher_index, length, teacher.hidden_size, torch_dtype)
        assert hidden.dtype == torch_dtype and hidden.shape == (length, teacher.hidden_size)
        # Bit-exact: compare the raw bit patterns, not values.
        assert torch.equal(
            hidden.view(torch.int16 if dtype == "bfloat16" else torch.int32),
            expected.view(torch.int16 if dtype == "bfloat16" else torch.int32),
        )
    assert seen_teachers == {0, 1, 2}
    for teacher in store.manifest.teachers:
        head = head_for(teacher.index, VOCAB_SIZE, teacher.hidden_size, torch_dtype)
        assert torch.equal(store.lm_head(teacher.index), head)
    # Nothing padded: each shard holds exactly its rows' tokens.
    for shard in store.manifest.shards:
        rows = store._array(shard.path, "row_ids").read()
        assert shard.tokens == sum(lengths[r] for r in rows)


def test_teacher_logits_rebuild(small_store: StoreSpec) -> None:
    store = open_store(small_store.root)
    for i in range(store.num_rows):
        row = store.row(i)
        teacher = store.teacher(row.teacher_index)
        hidden = hidden_for(i, teacher.index, len(row.input_ids), teacher.hidden_size, torch.float32)
        expected = hidden @ head_for(teacher.index, VOCAB_SIZE, teacher.hidden_size, torch.float32).T
        assert torch.equal(store.teacher_logits(i), expected)


def test_softcap_transform_applied(small_spec: StoreSpec) -> None:
    math_ckpt = small_spec.teachers["math"]
    spec = dataclasses.replace(small_spec, softcaps={math_ckpt: 5.0})
    build_store(spec)
    store = open_store(spec.root)
    teacher = next(t for t in store.manifest.teachers if t.checkpoint == math_ckpt)
    assert teacher.final_logit_softcap == 5.0
    i = next(i for i in range(store.num_rows) if store.row(i).teacher_index == teacher.index)
    raw = store.hidden(i).float() @ store.lm_head(teacher.index).float().T
    logits = store.teacher_logits(i)
    assert_close(logits, 5.0 * torch.tanh(raw / 5.0), what="capped logits")  # the same operations: exact
    assert logits.abs().max() < 5.0 < raw.abs().max()


def test_lm_head_slice_reads_only_overlapping_chunks(
    small_spec: StoreSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each slice decodes exactly the chunks it overlaps, and still reads with every other chunk of the
    head deleted."""
    from mopd.store.arrays import read as chunks

    # 48 hidden × 4 bytes × 16 rows = 3072 bytes per chunk → 300 rows in 19 chunks of 16 rows.
    spec = dataclasses.replace(small_spec, chunk_bytes=48 * 4 * 16)
    build_store(spec)
    store = open_store(spec.root)
    math = next(t for t in store.manifest.teachers if "math" in t.aliases)
    head_dir = Path(spec.root) / store.manifest.lm_heads[math.index].path
    full = head_for(math.index, VOCAB_SIZE, math.hidden_size, torch.float32)
    decoded: list[int] = []
    original = chunks.ArrayReader._decode
    monkeypatch.setattr(
        chunks.ArrayReader, "_decode", lambda self, i, *data: decoded.append(i) or original(self, i, *data)
    )
    for start, stop in [(0, 16), (15, 17), (40, 100), (290, 300), (100, 100)]:
        store.cache.clear()
        decoded.clear()
        assert torch.equal(store.lm_head(math.index, start, stop), full[start:stop])
        needed = list(range(start // 16, -(-stop // 16))) if stop > start else []
        assert sorted(decoded) == needed, (start, stop)
    shard = head_dir / "c" / "0" / "0"
    for chunk, (offset, size) in enumerate(inner_chunks(shard, 19)):
        if chunk not in {2, 3, 4, 5, 6}:  # garble every other inner chunk of the one shard file
            with shard.open("r+b") as f:
                f.seek(offset)
                f.write(bytes(size))
    store.cache.clear()
    assert torch.equal(store.lm_head(math.index, 40, 100), full[40:100])
    garbled = rf"teachers/{math.index}/lm_head: chunk 7 .* fails its crc32c"
    with pytest.raises(StoreIntegrityError, match=garbled):
        store.lm_head(math.index, 100, 120)


def inner_chunks(shard: Path, count: int) -> list[tuple[int, int]]:
    """(offset, size) of each inner chunk of a shard file, from its index at the end (zarr v3 spec)."""
    data = shard.read_bytes()
    index = np.frombuffer(data[-(16 * count + 4) : -4], dtype="<u8").reshape(count, 2)
    return [(int(offset), int(size)) for offset, size in index]


def test_lm_head_slice_past_vocabulary_is_zero_padding(small_store: StoreSpec) -> None:
    store = open_store(small_store.root)
    head = store.lm_head(0, VOCAB_SIZE - 4, VOCAB_SIZE + 6)
    assert head.shape == (10, store.teacher(0).hidden_size)
    assert torch.equal(head[:4], store.lm_head(0)[-4:])
    assert not head[4:].any()


def test_an_all_zero_chunk_is_written_and_read_back(tmp_path: Path) -> None:
    """Every chunk is on disk, zeros too: a reader that refuses missing chunks then reads a zero chunk
    as the zeros it holds (zarr skips such chunks by default, which would make them unreadable here)."""
    from mopd.store.arrays.read import ArrayReader
    from mopd.store.arrays.write import write_array

    data = np.zeros((64, 4), dtype=np.uint16)
    data[40:] = 7
    write_array(tmp_path / "a", data, chunk_bytes=16 * 4 * 2, codec="shuffle-zstd1")
    sizes = [size for _, size in inner_chunks(tmp_path / "a" / "c" / "0" / "0", 4)]
    assert len(sizes) == 4 and min(sizes) > 4  # four inner chunks in the one shard, none left out
    assert np.array_equal(ArrayReader(tmp_path / "a", label="a").read(), data)


@pytest.mark.parametrize("codec", ["shuffle-zstd1", "none"])
def test_zarr_python_and_tensorstore_read_the_shard_files_mopd_writes(tmp_path: Path, codec: str) -> None:
    """The one-shard layout is standard zarr v3 sharding: both libraries read mopd's files to the bit,
    the list of chunk checksums beside the shard (format 4) notwithstanding."""
    import tensorstore as ts
    import zarr

    from mopd.store.arrays.write import write_array

    rng = np.random.default_rng(0)
    arrays = {
        "hidden": rng.integers(0, 2**16, size=(1001, 24), dtype=np.uint16),  # 1001: a partial last chunk
        "offsets": np.cumsum(rng.integers(1, 9, size=333)).astype(np.int64),
        "mask": rng.integers(0, 2, size=517).astype(np.uint8),
    }
    for name, data in arrays.items():
        write_array(tmp_path / name, data, chunk_bytes=1000, codec=codec)
        assert sorted(p.name for p in (tmp_path / name).rglob("*") if p.is_file()) == [
            "0",
            "chunks.crc32c",
            "zarr.json",
        ]
        assert np.array_equal(zarr.open_array(zarr.storage.LocalStore(tmp_path / name), mode="r")[:], data)
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / name)}}
        assert np.array_equal(ts.open(spec).result().read().result(), data)
        assert np.array_equal(ArrayReader(tmp_path / name, label=name).read(), data)


def test_batched_reads_decode_each_chunk_once(small_spec: StoreSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """`rows` / `hiddens` of rows in any order (repeats too) equal the written data, and one call
    decodes each chunk it touches exactly once, however many of its rows fall in that chunk."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 60, size=40).tolist()
    spec = dataclasses.replace(
        small_spec, lengths=lengths, agents=["math", "code"] * 20, rows_per_task=7, chunk_bytes=1 << 14
    )
    build_store(spec)
    store = open_store(spec.root)
    wanted = np.array([*rng.permutation(40)[:25], 3, 3, 0])
    store.rows([0]), store.hiddens([0])  # row metadata (offsets, teachers, shard maps), read once
    decoded: list[tuple[str, int]] = []
    original = ArrayReader._decode
    monkeypatch.setattr(
        ArrayReader,
        "_decode",
        lambda self, index, *data: decoded.append((self.label, index)) or original(self, index, *data),
    )
    store.cache.clear()
    rows, states = store.rows(wanted), store.hiddens(wanted)
    batched = list(decoded)
    decoded.clear()
    for i in wanted.tolist():  # the chunks each row needs, read alone with nothing cached
        store.cache.clear()
        store.row(i), store.hidden(i)
    # Exactly the chunks the rows need, each once (read alone, the rows decoded 3x as many).
    assert sorted(batched) == sorted(set(decoded)) and len(decoded) > 2 * len(batched)
    for i, row, hidden in zip(wanted.tolist(), rows, states, strict=True):
        assert torch.equal(row.input_ids, torch.from_numpy(tokens_for(i, lengths[i])))
        teacher = store.teacher(row.teacher_index)
        expected = hidden_for(i, teacher.index, lengths[i], teacher.hidden_size, torch.float32)
        assert torch.equal(hidden.view(torch.int32), expected.view(torch.int32))
    with pytest.raises(IndexError, match="row 40 out of range"):
        store.hiddens([1, 40])

"""Every reader proves that what it reads is the file the store recorded, and never follows a link.

A chunk's crc32c proves only that the chunk is self-consistent, so these tests copy in files that pass
it: files of another store of the same rows and shapes, whose teachers' values differ. Each is refused
by `open_store`'s reads and by the default `verify-manifest`, with `codec: none` (the copy has the
recorded size) as with the default codec. A symbolic link anywhere in the store, even to an identical
copy of the file it replaces, is refused by every reader.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest

from mopd.base.errors import MopdError
from mopd.store import open_store
from mopd.store.arrays.binding import CRC_FILE
from mopd.store.format.layout import HIDDEN
from mopd.store.format.manifest import MANIFEST_FILE, PARTS_DIR
from mopd.store.verify import verify_store
from tests.store import synthetic
from tests.store.synthetic import StoreSpec, build_store


def read_everything(root: Path) -> None:
    store = open_store(root)
    everything = range(store.num_rows)
    store.rows(everything)
    store.hiddens(everything)
    for teacher in store.teachers:
        store.lm_head(teacher.index)


@pytest.fixture(params=["shuffle-zstd1", "none"])
def two_stores(
    request: pytest.FixtureRequest, small_spec: StoreSpec, tmp_path: Path
) -> tuple[Path, Path, str]:
    """A store, another of the same rows and shapes whose hidden states and heads differ, and the first
    teacher's first shard."""
    ours = dataclasses.replace(small_spec, codec=request.param)
    theirs = dataclasses.replace(ours, root=str(tmp_path / "other.zarr"))
    build_store(ours)
    hidden_for, head_for = synthetic.hidden_for, synthetic.head_for
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(synthetic, "hidden_for", lambda *args: hidden_for(*args) + 1)
        patch.setattr(synthetic, "head_for", lambda *args: head_for(*args) + 1)
        build_store(theirs)
    shard = open_store(ours.root).manifest.shards[0].path
    return Path(ours.root), Path(theirs.root), shard


COPIES = {  # what is copied from the other store: (paths, the array the refusal names)
    "a shard file": (["{shard}/hidden/c/0/0"], "{shard}/hidden"),
    "a shard and its checksums": (["{shard}/hidden/c/0/0", f"{{shard}}/hidden/{CRC_FILE}"], "{shard}/hidden"),
    "an array's folder": (["{shard}/hidden"], "{shard}/hidden"),
    "an LM head file": (["teachers/0/lm_head/c/0/0"], "teachers/0/lm_head"),
    "a task folder and its part record": (
        ["{shard}", f"{PARTS_DIR}/{{task}}.json"],
        f"{PARTS_DIR}/{{task}}.json",
    ),
}


@pytest.mark.parametrize("copy", sorted(COPIES))
def test_a_file_from_another_store_is_refused(two_stores: tuple[Path, Path, str], copy: str) -> None:
    ours, theirs, shard = two_stores
    task = f"teacher_000_shard_{int(shard.rsplit('_', 1)[1]):06d}"
    paths, named = COPIES[copy]
    for path in (p.format(shard=shard, task=task) for p in paths):
        if (ours / path).is_dir():
            shutil.rmtree(ours / path)
            shutil.copytree(theirs / path, ours / path)
        else:
            assert (theirs / path).read_bytes() != (ours / path).read_bytes()
            shutil.copyfile(theirs / path, ours / path)
    named = named.format(shard=shard, task=task)
    with pytest.raises(MopdError, match=named) as refused:
        read_everything(ours)
    assert "the store recorded" in str(refused.value) or "manifest lists" in str(refused.value)
    problems, _warnings = verify_store(ours)
    assert problems and any(named in line for line in problems), problems


def test_a_store_reads_and_verifies_with_every_chunk_bound(two_stores: tuple[Path, Path, str]) -> None:
    """The control: untouched, both stores read whole and verify, and their files differ."""
    ours, theirs, shard = two_stores
    for root in (ours, theirs):
        read_everything(root)
        assert verify_store(root) == ([], [])
    file = Path(shard, HIDDEN, "c", "0", "0")
    assert (ours / file).read_bytes() != (theirs / file).read_bytes()


LINKED = [
    MANIFEST_FILE,
    PARTS_DIR,
    f"{PARTS_DIR}/rows.json",
    "rows",
    "rows/input_ids/c/0",
    "teachers/0",
    "teachers/0/lm_head",
    "{shard}/hidden",
    "{shard}/hidden/c",
    "{shard}/hidden/c/0/0",
    f"{{shard}}/hidden/{CRC_FILE}",
    "{shard}/hidden/zarr.json",
]


@pytest.mark.parametrize("linked", LINKED)
def test_a_symbolic_link_anywhere_in_the_store_is_refused(
    small_store: StoreSpec, tmp_path: Path, linked: str
) -> None:
    """Each file or folder replaced by a link to an identical copy outside the store: every read and
    `verify-manifest` refuse it, naming the link, and verify reports nothing under it as missing."""
    root = Path(small_store.root)
    path = root / linked.format(shard=open_store(root).manifest.shards[0].path)
    outside = tmp_path / "outside" / path.name
    outside.parent.mkdir()
    shutil.move(path, outside)
    os.symlink(outside, path)
    with pytest.raises(MopdError, match="symbolic link"):
        read_everything(root)
    problems, _warnings = verify_store(root)
    assert any("symbolic link" in line for line in problems), problems
    assert not any("missing" in line for line in problems), problems

"""Acceptance: `mopd verify-manifest` exits 0 on a clean store and 1 with one line per problem."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result
from safetensors.torch import load_file, save_file

from mopd.base.completion import write_complete
from mopd.cli.main import cli
from mopd.store.format.manifest import MANIFEST_FILE, PARTS_DIR
from mopd.store.format.teachers import TeacherIdentity, write_teacher_list
from tests.store.synthetic import StoreSpec, make_checkpoint


def verify(*args: str) -> Result:
    return CliRunner().invoke(cli, ["verify-manifest", *args])


def problem_lines(result: Result) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.strip()]


def write_config(path: Path, teachers: dict[str, str], store: str) -> Path:
    path.write_text(
        yaml.safe_dump({"teachers": teachers, "data": {"path": "data.jsonl"}, "store": {"path": store}})
    )
    return path


def hidden_chunk(root: Path) -> Path:
    chunks = sorted((root / "teachers" / "0" / "shards" / "shard_000000" / "hidden" / "c").rglob("*"))
    return next(c for c in chunks if c.is_file())


def test_clean_store_passes(small_store: StoreSpec) -> None:
    result = verify(small_store.root, "--full")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("ok:")
    assert json.loads(verify(small_store.root, "--json").stdout) == []


def test_store_locations(small_store: StoreSpec) -> None:
    """A file:// URL names the folder; a URL of a scheme mopd does not read is refused with the reason,
    not read as a local folder `hdfs:/host/x`. (Buckets: tests/store/test_object_store.py.)"""
    assert verify(Path(small_store.root).as_uri(), "--full").exit_code == 0
    for command in (["verify-manifest"], ["inspect"]):
        refused = CliRunner().invoke(cli, [*command, "hdfs://host/teachers.zarr"])
        assert refused.exit_code == 2
        said = " ".join(refused.stderr.split())
        assert "hdfs://host/teachers.zarr: a store is a path, a file:// URL or an object-storage URL" in said
        assert "mopd does not know hdfs://" in said


def test_flipped_byte_found_by_full_only(small_store: StoreSpec) -> None:
    chunk = hidden_chunk(Path(small_store.root))
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    assert verify(small_store.root).exit_code == 0  # sizes unchanged: quick mode cannot see it
    result = verify(small_store.root, "--full")
    assert result.exit_code == 1
    lines = problem_lines(result)
    assert len(lines) == 1
    assert "teachers/0/shards/shard_000000/hidden/c/" in lines[0] and "content changed" in lines[0]


def test_truncated_chunk(small_store: StoreSpec) -> None:
    chunk = hidden_chunk(Path(small_store.root))
    chunk.write_bytes(chunk.read_bytes()[:-3])
    lines = problem_lines(result := verify(small_store.root))
    assert result.exit_code == 1 and len(lines) == 1
    assert "shard_000000/hidden/c/" in lines[0] and "truncated" in lines[0]


def test_deleted_shard(small_store: StoreSpec) -> None:
    shutil.rmtree(Path(small_store.root) / "teachers" / "2" / "shards" / "shard_000001")
    lines = problem_lines(result := verify(small_store.root))
    assert result.exit_code == 1 and len(lines) == 1
    assert lines[0].startswith("teachers/2/shards/shard_000001: missing")


def test_no_manifest_says_tasks_done(small_store: StoreSpec) -> None:
    root = Path(small_store.root)
    (root / MANIFEST_FILE).unlink()
    (root / PARTS_DIR / "teacher_002_shard_000000.json").unlink()
    total = len(list((root / PARTS_DIR).glob("*.json"))) + 1
    lines = problem_lines(result := verify(small_store.root))
    assert result.exit_code == 1 and len(lines) == 1
    assert f"{total - 1} of {total} tasks are done" in lines[0]


def _edit_manifest(root: Path, **changes: object) -> None:
    path = root / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


def test_a_newer_format_version(small_store: StoreSpec) -> None:
    _edit_manifest(Path(small_store.root), format_version=5)
    lines = problem_lines(result := verify(small_store.root))
    assert result.exit_code == 1 and len(lines) == 1
    assert "format_version 5 is newer than this mopd (reads 4); upgrade mopd" in lines[0]


def test_unknown_required_feature(small_store: StoreSpec) -> None:
    _edit_manifest(Path(small_store.root), required_features=["sparse-topk"])
    lines = problem_lines(result := verify(small_store.root))
    assert result.exit_code == 1 and len(lines) == 1
    assert "sparse-topk" in lines[0] and "upgrade mopd" in lines[0]


def test_config_with_same_teachers_passes(small_store: StoreSpec, tmp_path: Path) -> None:
    # Aliases renamed and reordered: numbering is by checkpoint, so nothing changes.
    teachers = {
        "z-code": small_store.teachers["code"],
        "a-chat": small_store.teachers["chat"],
        "m": small_store.teachers["math"],
    }
    config = write_config(tmp_path / "same.yaml", teachers, small_store.root)
    result = verify(small_store.root, "--config", str(config))
    assert result.exit_code == 0, result.output


def test_config_renumbering_teachers(small_store: StoreSpec, tmp_path: Path) -> None:
    # A new checkpoint that sorts before all others shifts every index by one.
    extra = make_checkpoint(tmp_path / "ckpt" / "a-first-teacher", hidden_size=16, seed=9)
    teachers = {**small_store.teachers, "new": str(extra)}
    config = write_config(tmp_path / "renumber.yaml", teachers, small_store.root)
    lines = problem_lines(result := verify(small_store.root, "--config", str(config)))
    assert result.exit_code == 1
    assert sum("renumbered" in line for line in lines) == 3
    assert sum("added in the config" in line and "a-first-teacher" in line for line in lines) == 1
    assert len(lines) == 4


def test_config_dropped_teacher(small_store: StoreSpec, tmp_path: Path) -> None:
    teachers = {k: v for k, v in small_store.teachers.items() if k != "chat"}  # chat sorts first: 0
    config = write_config(tmp_path / "dropped.yaml", teachers, small_store.root)
    lines = problem_lines(result := verify(small_store.root, "--config", str(config)))
    assert result.exit_code == 1
    assert any("dropped from the config" in line and "chat-teacher" in line for line in lines)


def test_config_added_teacher(small_store: StoreSpec, tmp_path: Path) -> None:
    extra = make_checkpoint(tmp_path / "ckpt" / "zz-last-teacher", hidden_size=16, seed=9)
    config = write_config(
        tmp_path / "added.yaml", {**small_store.teachers, "new": str(extra)}, small_store.root
    )
    lines = problem_lines(result := verify(small_store.root, "--config", str(config)))
    assert result.exit_code == 1 and len(lines) == 1
    assert "teacher 3" in lines[0] and "added in the config" in lines[0]


def test_changed_fingerprint_at_same_path(small_store: StoreSpec, tmp_path: Path) -> None:
    ckpt = Path(small_store.teachers["code"])
    weights = load_file(ckpt / "model.safetensors")
    weights["lm_head.weight"][0, 0] += 1
    save_file(weights, ckpt / "model.safetensors")
    config = write_config(tmp_path / "changed.yaml", small_store.teachers, small_store.root)
    lines = problem_lines(result := verify(small_store.root, "--config", str(config)))
    assert result.exit_code == 1 and len(lines) == 1
    assert lines[0].startswith("teacher 1 (code): the store's is") and "code-teacher" in lines[0]
    assert "a different teacher" in lines[0]


def test_checkpoint_with_different_teacher_list(small_store: StoreSpec, tmp_path: Path) -> None:
    from mopd.store import open_store

    teachers = [
        TeacherIdentity(t.index, t.checkpoint, t.fingerprint) for t in open_store(small_store.root).teachers
    ]
    good = tmp_path / "step_000010"
    good.mkdir()
    write_teacher_list(good, teachers)
    write_complete(good, {"step": 10})
    assert verify(small_store.root, "--checkpoint", str(good)).exit_code == 0
    swapped = tmp_path / "step_000020"
    swapped.mkdir()
    write_teacher_list(
        swapped,
        [
            TeacherIdentity(0, teachers[1].checkpoint, teachers[1].fingerprint),
            TeacherIdentity(1, teachers[0].checkpoint, teachers[0].fingerprint),
            teachers[2],
        ],
    )
    write_complete(swapped, {"step": 20})
    lines = problem_lines(result := verify(small_store.root, "--checkpoint", str(swapped)))
    assert result.exit_code == 1 and len(lines) == 2
    assert all("renumbered" in line and "checkpoint" in line for line in lines)


@pytest.mark.parametrize("as_json", [False, True])
def test_reports_every_problem(small_store: StoreSpec, tmp_path: Path, as_json: bool) -> None:
    root = Path(small_store.root)
    chunk = hidden_chunk(root)
    chunk.write_bytes(chunk.read_bytes()[:-1])
    shutil.rmtree(root / "teachers" / "2" / "shards" / "shard_000000")
    extra = make_checkpoint(tmp_path / "ckpt" / "zz-last-teacher", hidden_size=16, seed=9)
    config = write_config(tmp_path / "added.yaml", {**small_store.teachers, "new": str(extra)}, str(root))
    args = [str(root), "--config", str(config), *(["--json"] if as_json else [])]
    result = verify(*args)
    assert result.exit_code == 1
    problems = json.loads(result.stdout) if as_json else problem_lines(result)
    assert len(problems) == 3
    assert any("truncated" in p for p in problems)
    assert any("shard_000000: missing" in p and "teachers/2" in p for p in problems)
    assert any("added in the config" in p for p in problems)


def test_part_record_paths_cannot_escape_the_store(small_store: StoreSpec) -> None:
    from mopd.base.fsio import sha256_file

    root = Path(small_store.root)
    part_path = root / PARTS_DIR / "teacher_001_shard_000000.json"
    part = json.loads(part_path.read_text())
    part["files"]["../../../../../etc/hostname"] = [1, "0" * 64]
    part_path.write_text(json.dumps(part))
    # Make the manifest vouch for the tampered record so that only the path check stands in the way.
    manifest = json.loads((root / MANIFEST_FILE).read_text())
    for shard in manifest["shards"]:
        if shard["task_id"] == "teacher_001_shard_000000":
            from mopd.store.format.manifest import artifact_hash

            shard["part_sha256"] = sha256_file(part_path)
            shard["hash"] = artifact_hash({k: tuple(v) for k, v in part["files"].items()})
    (root / MANIFEST_FILE).write_text(json.dumps(manifest))
    lines = problem_lines(result := verify(small_store.root, "--full"))
    assert result.exit_code == 1 and len(lines) == 1
    assert "must be relative and stay inside the store" in lines[0]


def test_array_shape_differing_from_the_record(small_store: StoreSpec) -> None:
    # Same byte count (300 → 299), so only the shape check can see it.
    meta = Path(small_store.root) / "teachers" / "0" / "lm_head" / "zarr.json"
    text = meta.read_text()
    assert '"shape": [\n    300,' in text
    meta.write_text(text.replace('"shape": [\n    300,', '"shape": [\n    299,'))
    lines = problem_lines(result := verify(small_store.root))
    assert result.exit_code == 1 and lines == ["teachers/0/lm_head: shape (299, 32), recorded (300, 32)"]


def test_config_with_two_aliases_swapped(small_store: StoreSpec, tmp_path: Path) -> None:
    """The same checkpoints, so the same indices, but math and code trade places: the store's rows were
    routed the other way round, and each swapped alias is named."""
    teachers = {
        **small_store.teachers,
        "math": small_store.teachers["code"],
        "code": small_store.teachers["math"],
    }
    config = write_config(tmp_path / "swapped.yaml", teachers, small_store.root)
    lines = problem_lines(result := verify(small_store.root, "--config", str(config)))
    assert result.exit_code == 1 and len(lines) == 2, lines
    code, math = sorted(lines)
    assert code.startswith("alias code names teacher 1 (") and "math-teacher (the store's teacher 2)" in code
    assert math.startswith("alias math names teacher 2 (") and "code-teacher (the store's teacher 1)" in math


@pytest.mark.parametrize("caller_threads", [0, 1], ids=["fork", "forkserver"])
def test_folders_checked_in_several_processes_find_what_one_process_finds(
    small_store: StoreSpec, caller_threads: int
) -> None:
    """Large stores split the folder checks over processes: the same problems, in the same order, and
    the same files to hash, as one process; also from a caller with threads running (whose children
    start from a fork server)."""
    from mopd.store.format.loading import read_manifest
    from mopd.store.locations.folder import Folder
    from mopd.store.verify import _folder_checks

    root = Path(small_store.root)
    chunk = hidden_chunk(root)
    chunk.write_bytes(chunk.read_bytes()[:-1])
    shutil.rmtree(root / "teachers" / "2" / "shards" / "shard_000000")
    (root / "teachers" / "0" / "lm_head" / "stray").write_bytes(b"x")
    manifest = read_manifest(root)

    def checked(blocks: Iterable[tuple[list[str], list[Any]]]) -> tuple[list[str], list[Any]]:
        done = list(blocks)
        return [p for found, _ in done for p in found], [f for _, files in done for f in files]

    one = checked(_folder_checks(Folder(root), manifest))
    release = threading.Event()
    running = [threading.Thread(target=release.wait) for _ in range(caller_threads)]
    for thread in running:
        thread.start()
    try:
        several = checked(_folder_checks(Folder(root), manifest, parallel_from=1, per_block=1))
    finally:
        release.set()
    for thread in running:
        thread.join()
    assert several == one and len(one[0]) == 3 and len(one[1]) > 10


def test_temporaries_of_stopped_jobs_are_listed_with_the_command_that_removes_them(
    small_store: StoreSpec,
) -> None:
    """Another host's leftover task folder and an earlier mopd's record temporary: the store is sound
    (exit 0), and each is one warning naming who left it and the `rm` that removes it."""
    root = Path(small_store.root)
    folder = root / "teachers" / "0" / "shards" / f"shard_000000.tmp-4242@elsewhere-{'0' * 32}"
    folder.mkdir()
    (folder / "partial").write_bytes(b"half a shard")
    record = root / PARTS_DIR / f"rows.json.tmp-{'1' * 32}"
    record.write_bytes(b"{")
    result = verify(small_store.root)
    assert result.exit_code == 0 and result.stdout.startswith("ok:"), result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        f"warning: _parts/{record.name}: a temporary left by a job that stopped (a job of an earlier mopd), "
        f"not part of the store; once no job writes this store, remove it with `rm -rf {record}`",
        f"warning: teachers/0/shards/{folder.name}: a temporary left by a job that stopped (process 4242 "
        f"on elsewhere), not part of the store; once no job writes this store, remove it with `rm -rf "
        f"{folder}`",
    ], result.stderr

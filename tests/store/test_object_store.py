"""A store in an S3 bucket (a local moto server) is the store on disk, byte for byte, under the same commit
protocol: create-only writes instead of exclusive create and rename, and reads by byte ranges that refuse
a missing, replaced or altered object by name."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import boto3
import numpy as np
import obstore
import pytest
import torch
from botocore.exceptions import ClientError
from click.testing import CliRunner

from mopd.base.errors import FilesystemError, StoreIntegrityError
from mopd.cli.main import cli
from mopd.store import open_store
from mopd.store.arrays import read as chunks
from mopd.store.format.layout import HIDDEN
from mopd.store.format.loading import load_manifest, load_part, part_key
from mopd.store.format.manifest import MANIFEST_FILE, PARTS_DIR
from mopd.store.locations.bucket import Bucket
from mopd.store.locations.location import merged, open_location
from mopd.store.verify import verify_store
from mopd.store.writer import StoreWriter
from tests.object_store import S3Server
from tests.store.synthetic import StoreSpec, build_plan, build_store


def in_bucket(spec: StoreSpec, bucket: str) -> StoreSpec:
    return dataclasses.replace(spec, root=f"{bucket}/teachers.zarr")


def client(server: S3Server) -> object:
    return boto3.client("s3", endpoint_url=server.moto_endpoint, region_name="us-east-1")


def test_a_store_in_a_bucket_is_the_store_on_disk(small_spec: StoreSpec, s3_bucket: str) -> None:
    build_store(small_spec)
    remote = in_bucket(small_spec, s3_bucket)
    build_store(remote)
    local_files = open_location(small_spec.root).digests("")
    assert open_location(remote.root).digests("") == local_files  # every object: size and sha256
    assert load_manifest(remote.root).hash() == load_manifest(small_spec.root).hash()

    on_disk, in_bucket_ = open_store(small_spec.root), open_store(remote.root)
    rows = np.arange(on_disk.num_rows)
    assert all(
        torch.equal(a, b) for a, b in zip(on_disk.hiddens(rows), in_bucket_.hiddens(rows), strict=True)
    )
    for a, b in zip(on_disk.rows(rows), in_bucket_.rows(rows), strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and a.teacher_index == b.teacher_index
    for teacher in on_disk.teachers:
        assert torch.equal(on_disk.lm_head(teacher.index, 3, 90), in_bucket_.lm_head(teacher.index, 3, 90))
    assert verify_store(remote.root) == ([], [])
    assert verify_store(remote.root, full=True) == ([], [])


def test_the_server_answers_a_second_create_with_412(s3_server: S3Server, s3_bucket: str) -> None:
    """The commit protocol stands on this answer (one moto release gave 500): `If-None-Match: *` on a key
    that exists is 412 Precondition Failed, which obstore raises as AlreadyExistsError."""
    s3 = client(s3_server)
    bucket = s3_bucket.removeprefix("s3://")
    s3.put_object(Bucket=bucket, Key="record", Body=b"a", IfNoneMatch="*")  # type: ignore[attr-defined]
    with pytest.raises(ClientError) as refused:
        s3.put_object(Bucket=bucket, Key="record", Body=b"b", IfNoneMatch="*")  # type: ignore[attr-defined]
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    store = Bucket(s3_bucket)
    assert store.create_exclusive("other", b"a") and not store.create_exclusive("other", b"b")
    assert bytes(obstore.get(store.store, "other").bytes()) == b"a"


def test_the_server_leaves_flask_out_of_the_test_process(s3_bucket: str) -> None:
    """moto's server is a Flask app; in this process Flask's `request` breaks the vLLM engine start of any
    vLLM test that runs after the object-store tests (see tests/object_store.py)."""
    assert Bucket(s3_bucket).create_exclusive("record", b"a")  # the server answers
    assert "flask" not in sys.modules and "moto" not in sys.modules


def test_a_bucket_without_conditional_writes_is_refused_at_open(
    small_spec: StoreSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    lesser = S3Server(drop_conditions=True)  # a service that ignores If-None-Match
    try:
        for name, value in lesser.environment().items():
            monkeypatch.setenv(name, value)
        url = f"{lesser.bucket()}/teachers.zarr"
        with pytest.raises(FilesystemError) as refused:
            StoreWriter.open(url, build_plan(small_spec)[0])
    finally:
        lesser.stop()
    message = str(refused.value)
    assert "\n" not in message and url in message
    assert "If-None-Match" in message and "conditional writes" in message


def test_a_task_two_writers_race_on_is_published_once(small_spec: StoreSpec, s3_bucket: str) -> None:
    """Two jobs write one task (a requeue, a duplicated array index): the second to publish finds every
    object and the part record there, with its own bytes; it replaces nothing and records nothing."""
    build_store(small_spec)  # a twin on disk: what the task's bytes are
    remote = in_bucket(small_spec, s3_bucket)
    plan = build_plan(remote)[0]
    task = plan.tasks[-1]
    twin = Path(small_spec.root) / task.path
    twin_part = load_part(small_spec.root, task.task_id)
    location = Bucket(remote.root)
    with StoreWriter.open(remote.root, plan).task(task.task_id) as out:
        shutil.copytree(twin, out.folder, dirs_exist_ok=True)
        out.num_rows, out.num_tokens = twin_part.num_rows, twin_part.num_tokens
        build_store(dataclasses.replace(remote, only_tasks=[task.task_id]))  # the other job, to the end
        versions = {key: location.stat(key, key) for key in location.listing("")[0]}
    assert {key: location.stat(key, key) for key in location.listing("")[0]} == versions
    assert location.names(PARTS_DIR) == [f"{task.task_id}.json"]
    assert load_part(remote.root, task.task_id) == twin_part


def test_a_stopped_jobs_leftover_is_replaced_and_a_recorded_task_is_not(
    small_spec: StoreSpec, s3_bucket: str
) -> None:
    """Objects of a task without a part record are not the store's: a rerun writes over them. Once the
    part record exists, other bytes for the task are refused, naming it."""
    remote = in_bucket(small_spec, s3_bucket)
    plan = build_plan(remote)[0]
    shard = plan.tasks[-1]
    location = Bucket(remote.root)
    leftover = f"{shard.path}/{HIDDEN}/c/0/0"
    obstore.put(location.store, leftover, b"half of a killed job's shard")
    build_store(remote)
    assert verify_store(remote.root, full=True) == ([], [])
    assert location.read(leftover, leftover, limit=8) != b"half of a"

    writer = StoreWriter.open(remote.root, plan)
    refused = pytest.raises(StoreIntegrityError, match=f"task {shard.task_id}: .*different content")
    with refused, writer.task(shard.task_id) as out:
        (out.folder / HIDDEN).mkdir(parents=True)
        (out.folder / HIDDEN / "zarr.json").write_bytes(b"{}")
    assert verify_store(remote.root, full=True) == ([], [])


def test_a_deleted_or_altered_object_is_named(small_spec: StoreSpec, s3_bucket: str) -> None:
    remote = in_bucket(small_spec, s3_bucket)
    build_store(remote)
    location = Bucket(remote.root)
    manifest = load_manifest(remote.root)
    gone, changed = manifest.shards[0], manifest.shards[1]
    shard_key = f"{changed.path}/{HIDDEN}/c/0/0"
    data = bytearray(bytes(obstore.get(location.store, shard_key).bytes()))
    data[10] ^= 0x40
    obstore.put(location.store, shard_key, bytes(data))
    obstore.delete(location.store, f"{gone.path}/{HIDDEN}/c/0/0")

    store = open_store(remote.root)
    for artifact, position in ((gone, 0), (changed, 1)):
        shard_of = store._row_locations[artifact.teacher][0]
        row = int(np.flatnonzero(shard_of == position)[0])
        with pytest.raises(StoreIntegrityError, match=f"{artifact.path}/{HIDDEN}"):
            store.hidden(row)
    # A byte changed inside a chunk keeps the sizes, the index and the trailers: `--full` finds it.
    assert any(f"{gone.path}/{HIDDEN}/c/0/0: missing" in p for p in verify_store(remote.root)[0])
    problems = verify_store(remote.root, full=True)[0]
    assert f"{changed.path}/{HIDDEN}/c/0/0: content changed (sha256 differs from the record)" in problems
    assert location.exists(MANIFEST_FILE) and location.exists(part_key(gone.task_id))


def test_a_replaced_object_is_refused_while_a_reader_holds_it(small_spec: StoreSpec, s3_bucket: str) -> None:
    """A reader reads each shard at the version it first saw: an object replaced under it (even by the
    same bytes) is refused, never mixed with the bytes it read before."""
    remote = in_bucket(small_spec, s3_bucket)
    build_store(remote)
    store = open_store(remote.root)
    shard = store.manifest.shards[0]
    rows = np.flatnonzero(store._row_locations[shard.teacher][0] == 0)
    store.hidden(int(rows[0]))
    location = Bucket(remote.root)
    key = f"{shard.path}/{HIDDEN}/c/0/0"
    obstore.put(location.store, key, bytes(obstore.get(location.store, key).bytes()) + b"")
    store.cache.clear()
    obstore.put(location.store, key, bytes(obstore.get(location.store, key).bytes())[:-1] + b"\0")
    with pytest.raises(StoreIntegrityError, match="replaced while the store was read"):
        store.hidden(int(rows[-1]))


def test_close_ranges_share_a_request() -> None:
    ranges = [(5000, 10), (0, 100), (100, 50), (3 << 20, 4)]
    assert merged(ranges, gap=1 << 20) == [(0, 5010, [1, 2, 0]), (3 << 20, (3 << 20) + 4, [3])]
    assert merged(ranges, gap=0) == [
        (0, 100, [1]),
        (100, 150, [2]),
        (5000, 5010, [0]),
        (3 << 20, (3 << 20) + 4, [3]),
    ]


def test_a_steps_chunks_of_one_shard_come_in_one_request(
    small_spec: StoreSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The inner chunks a read needs from one shard lie within 1 MiB: one GET fetches them all, however
    many they are (counted at a proxy in front of the server)."""
    counted = S3Server(delay=1e-4)
    try:
        for name, value in counted.environment().items():
            monkeypatch.setenv(name, value)
        spec = dataclasses.replace(small_spec, root=f"{counted.bucket()}/teachers.zarr", chunk_bytes=512)
        build_store(spec)
        store = open_store(spec.root)
        shard_of = store._row_locations[store.manifest.shards[0].teacher][0]
        rows = np.flatnonzero(shard_of == 0)
        store.hidden(int(rows[0]))  # the shard's header, checksum list and index, read once
        store.cache.chunks.clear()
        decoded: list[int] = []
        original = chunks.ArrayReader._decode
        monkeypatch.setattr(
            chunks.ArrayReader,
            "_decode",
            lambda self, i, *data: decoded.append(i) or original(self, i, *data),
        )
        before = counted.requests
        store.hiddens(rows)
        assert counted.requests - before == 1 and len(decoded) >= 3
    finally:
        counted.stop()


def test_verify_manifest_and_inspect_take_a_bucket(small_spec: StoreSpec, s3_bucket: str) -> None:
    remote = in_bucket(small_spec, s3_bucket)
    build_store(remote)
    verified = CliRunner().invoke(cli, ["verify-manifest", remote.root, "--full"])
    assert verified.exit_code == 0 and verified.stdout.startswith(f"ok: {remote.root} is complete")
    inspected = CliRunner().invoke(cli, ["inspect", remote.root, "--json"])
    assert inspected.exit_code == 0, inspected.output
    summary = json.loads(inspected.stdout)
    assert summary["path"] == remote.root and summary["rows"] == len(small_spec.lengths)
    missing = CliRunner().invoke(cli, ["verify-manifest", f"{s3_bucket}/nothing.zarr"])
    assert missing.exit_code == 1 and f"store {s3_bucket}/nothing.zarr does not exist" in missing.stdout

"""Training from a store in an S3 bucket (a local moto server): the losses of the same store on disk, bit
for bit; a resume continues them; a deleted or altered object stops `mopd train` with exit 1, naming
the object, before a step trains on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import obstore
import pytest
from click.testing import CliRunner

from mopd.cli.main import cli
from mopd.store.format.layout import HIDDEN
from mopd.store.format.loading import load_manifest
from mopd.store.locations.bucket import Bucket
from mopd.store.locations.folder import Folder
from mopd.train.trainer import run_training
from tests.fault_trials import train_records
from tests.train.world import World, world_config


def upload(folder: Path, url: str) -> Bucket:
    """The store on disk, copied object by object into the bucket."""
    bucket = Bucket(url)
    for key in Folder(folder).listing("")[0]:
        obstore.put(bucket.store, key, (folder / key).read_bytes())
    return bucket


def losses(run: Path) -> list[tuple[int, Any, Any]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in train_records(run)]


def test_training_from_a_bucket_gives_the_losses_from_disk_and_resumes(
    world: World, tmp_path: Path, s3_bucket: str
) -> None:
    url = f"{s3_bucket}/teachers.zarr"
    upload(world.store, url)
    settings: dict[str, Any] = {"steps": 4, "checkpoint": {"every": 2, "keep": 2}}
    run_training(world_config(world, tmp_path / "disk", **settings), log=lambda _line: None)
    bucket = world_config(world, tmp_path / "bucket", store=url, **settings)  # type: ignore[arg-type]
    assert bucket.store.path == url
    run_training(bucket, max_steps=2, log=lambda _line: None)
    resumed = run_training(bucket, log=lambda _line: None)
    assert resumed.first_step == 3
    expected = losses(tmp_path / "disk" / "run")
    assert len(expected) == 4
    assert losses(tmp_path / "bucket" / "run") == expected


@pytest.mark.parametrize("damage", ["deleted", "altered"])
def test_a_damaged_object_stops_training_naming_it(
    world: World, tmp_path: Path, s3_bucket: str, damage: str
) -> None:
    url = f"{s3_bucket}/teachers.zarr"
    bucket = upload(world.store, url)
    shard = load_manifest(url).shards[0]
    key = f"{shard.path}/{HIDDEN}/c/0/0"
    if damage == "deleted":
        obstore.delete(bucket.store, key)
    else:
        data = bytearray(bytes(obstore.get(bucket.store, key).bytes()))
        data[len(data) // 3] ^= 0x10
        obstore.put(bucket.store, key, bytes(data))
    world_config(world, tmp_path, store=url, steps=4)  # type: ignore[arg-type]
    out = CliRunner().invoke(cli, ["train", str(tmp_path / "config.yaml")])
    assert out.exit_code == 1, out.output
    assert f"{shard.path}/{HIDDEN}" in out.output and "Traceback" not in out.output
    said = "missing" if damage == "deleted" else "crc32c"
    assert said in out.output.split("error:")[-1]
    trained = train_records(tmp_path / "run") if (tmp_path / "run" / "metrics.jsonl").exists() else []
    assert len(trained) < 4  # the run stopped at the step that read it, before training on it

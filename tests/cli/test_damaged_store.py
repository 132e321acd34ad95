"""Reads never invent data: a deleted, truncated or bit-flipped chunk of any array the trainer reads, or a
file copied in from another store of the same rows, stops `mopd train` with exit 1, naming the array and
the chunk, before the optimizer takes a step over any row the chunk holds; `verify-manifest` names the
same file (`--full` for damage, the default check for a copied file)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from mopd.cli.main import cli
from mopd.config.mopd_config import load_config
from mopd.precompute.runner import run_precompute
from mopd.store import ManifestError, open_store
from mopd.store.format.layout import HIDDEN, INPUT_IDS, LOSS_MASK, OFFSETS, ROW_IDS, TEACHER_INDEX
from mopd.train.data.order import LoaderState
from mopd.train.report.metrics import METRICS_FILE, read_metrics
from mopd.train.trainer import Trainer
from tests.precompute.teachers import make_tokenizer, save_teacher
from tests.train.world import World, world_config, write_train_config

ARRAYS = {  # "{shard}": the shard whose rows come up last
    "input_ids": f"rows/{INPUT_IDS}",
    "loss_mask": f"rows/{LOSS_MASK}",
    "row_offsets": f"rows/{OFFSETS}",
    "teacher_index": f"rows/{TEACHER_INDEX}",
    "lm_head": "teachers/0/lm_head",
    "hidden": f"{{shard}}/{HIDDEN}",
    "shard_offsets": f"{{shard}}/{OFFSETS}",
    "row_ids": f"{{shard}}/{ROW_IDS}",
}


# Steps of a few rows each, so that some shard's rows come up only after the first steps.
TRAIN = dict(steps=10, batch={"micro_batch_tokens": 256, "global_batch_tokens": 256})


def damage(chunk: Path, how: str) -> None:
    data = chunk.read_bytes()
    if how == "delete":
        chunk.unlink()
    elif how == "truncate":
        chunk.write_bytes(data[: len(data) // 2])
    else:  # one bit in the middle of the payload (not the 4-byte checksum at the end)
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x10
        chunk.write_bytes(bytes(flipped))


@pytest.fixture(scope="module")
def late_shard(world: World, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """The shard whose rows the trainer reads last, and the first step that reads one (from the
    loader's own plan)."""
    trainer = Trainer(world_config(world, tmp_path_factory.mktemp("plan"), **TRAIN), log=lambda _line: None)
    first_step: dict[int, int] = {}
    plan = trainer.loader._plan(LoaderState(trainer.tc.seed))
    for step, (micro_rows, _after) in zip(range(1, 11), plan, strict=False):
        for row in (int(r) for batch in micro_rows for r in batch):
            first_step.setdefault(row, step)
    store = open_store(world.store)
    starts = {
        shard.path: min(first_step.get(int(r), 99) for r in store._array(shard.path, ROW_IDS).read())
        for shard in store.manifest.shards
    }
    path = max(starts, key=lambda p: starts[p])
    assert 1 < starts[path] <= 10  # so that the test sees steps train before it
    return path, starts[path]


@pytest.mark.parametrize("how", ["delete", "truncate", "flip"])
@pytest.mark.parametrize("array", sorted(ARRAYS))
def test_train_stops_at_a_damaged_chunk(
    world: World, tmp_path: Path, late_shard: tuple[str, int], array: str, how: str
) -> None:
    shard, shard_first_step = late_shard
    store = Path(shutil.copytree(world.store, tmp_path / "store.zarr"))
    path = ARRAYS[array].format(shard=shard)
    chunk = next(p for p in sorted((store / path / "c").rglob("*")) if p.is_file())
    damage(chunk, how)
    config = tmp_path / "config.yaml"
    world_config(world, tmp_path, store=store, **TRAIN)
    result = CliRunner().invoke(cli, ["train", str(config), "--output", str(tmp_path / "run")])
    assert result.exit_code == 1, result.output
    message = " ".join(result.stderr.split())
    assert message.startswith(f"error: {path}: chunk 0 ") or f"{path}/c/" in message, message
    assert "Traceback" not in result.stderr
    metrics = tmp_path / "run" / METRICS_FILE
    steps = [r["step"] for r in read_metrics(metrics)] if metrics.exists() else []
    # A shard's states are read with its rows, which first come up at `shard_first_step`: the steps
    # before it train, it and later ones never do. Everything else, the shards' offsets and row ids
    # included (the row metadata the loader holds in memory), is read before step 1.
    read_with_rows = array == "hidden"
    assert steps == (list(range(1, shard_first_step)) if read_with_rows else [])
    verify = CliRunner().invoke(cli, ["verify-manifest", str(store), "--full"])
    assert verify.exit_code == 1
    assert any(f"{path}/c/" in line for line in verify.stdout.splitlines()), verify.stdout


def _precompute(world: World, folder: Path, teachers: dict[str, Path], codec: str) -> Path:
    store = folder / "store.zarr"
    path = write_train_config(folder, teachers, data=world.data, store=store, student=world.student)
    raw = yaml.safe_load(path.read_text())
    raw["store"]["codec"] = codec
    path.write_text(yaml.safe_dump(raw))
    run_precompute(load_config(path), log=lambda *_: None)
    return store


@pytest.fixture(scope="module")
def two_stores(world: World, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per codec: a store of the world, and one of the same rows by two other teachers of the same shapes
    (their checkpoints sort alike, so every teacher has the same index in both)."""
    root = tmp_path_factory.mktemp("other")
    tokenizer = make_tokenizer()
    others = {
        "code": save_teacher(root / "code-teacher", "qwen2", hidden_size=64, seed=14, tokenizer=tokenizer),
        "math": save_teacher(root / "math-teacher", "llama", hidden_size=64, seed=15, tokenizer=tokenizer),
    }
    return {
        "shuffle-zstd1": (world.store, _precompute(world, root / "zstd", others, "shuffle-zstd1")),
        "none": (
            _precompute(world, root / "none-world", world.teachers, "none"),
            _precompute(world, root / "none-other", others, "none"),
        ),
    }


@pytest.mark.parametrize("array", ["hidden", "lm_head"])
@pytest.mark.parametrize("codec", ["shuffle-zstd1", "none"])
def test_a_file_copied_from_another_store_is_refused(
    world: World,
    tmp_path: Path,
    late_shard: tuple[str, int],
    two_stores: dict[str, tuple[Path, Path]],
    codec: str,
    array: str,
) -> None:
    """A same-shape shard or LM-head file of another store of the same rows, copied in: each chunk of
    it passes its own crc32c, yet `mopd train` exits 1 naming the file before a step trains on it, and
    the default `verify-manifest` exits 1 naming it. With `codec: none` the file even has the recorded
    size: only the chunk checksums listed beside it (format 4) tell it apart."""
    shard, shard_first_step = late_shard
    ours, theirs = two_stores[codec]
    store = Path(shutil.copytree(ours, tmp_path / "store.zarr"))
    path = ARRAYS[array].format(shard=shard)
    shard_file = Path(path, "c", "0", "0")
    assert (theirs / shard_file).read_bytes() != (store / shard_file).read_bytes()
    if codec == "none":
        assert (theirs / shard_file).stat().st_size == (store / shard_file).stat().st_size
    shutil.copyfile(theirs / shard_file, store / shard_file)
    world_config(world, tmp_path, store=store, **TRAIN)
    result = CliRunner().invoke(
        cli, ["train", str(tmp_path / "config.yaml"), "--output", str(tmp_path / "run")]
    )
    assert result.exit_code == 1, result.output
    message = " ".join(result.stderr.split())
    assert f"error: {path}: " in message and "the store recorded" in message, message
    assert "Traceback" not in result.stderr
    metrics = tmp_path / "run" / METRICS_FILE
    steps = [r["step"] for r in read_metrics(metrics)] if metrics.exists() else []
    assert steps == (list(range(1, shard_first_step)) if array == "hidden" else [])
    verify = CliRunner().invoke(cli, ["verify-manifest", str(store)])
    assert verify.exit_code == 1
    assert any(line.startswith(f"{path}") for line in verify.stdout.splitlines()), verify.stdout


FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.mark.parametrize("version", [1, 2, 3])
def test_a_store_of_an_earlier_format_is_refused_in_one_line(version: int, tmp_path: Path) -> None:
    """The committed stores of formats 1-3 (written before mopd 0.1.0): training, `verify-manifest` and
    `inspect` each refuse them in one line that names the format version and says to rebuild."""
    store = Path(shutil.copytree(FIXTURES / f"store-v{version}.zarr", tmp_path / f"v{version}.zarr"))
    refusal = rf"format_version {version} is a store format this mopd does not read .* rebuild the store"
    with pytest.raises(ManifestError, match=refusal) as refused:
        open_store(store)
    assert "\n" not in str(refused.value)
    for command in (["verify-manifest", str(store)], ["inspect", str(store)]):
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 1
        assert re.search(refusal, result.output) and len(result.output.strip().splitlines()) == 1, (
            result.output
        )

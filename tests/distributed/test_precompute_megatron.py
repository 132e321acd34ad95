"""Acceptance: the megatron teacher backend at TP=2 and PP=2 writes the hf backend's store — under the real
launcher (`torchrun`, two model-parallel groups of two ranks) and on the harness's ranks running the same
command (`run_mopd`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from mopd.store import open_store
from tests.distributed.harness import run_mopd, run_torchrun
from tests.mopd_process import run_mopd_process
from tests.precompute.conftest import routed_config
from tests.precompute.stores import assert_fp32_equal, build
from tests.precompute.teachers import make_tokenizer, save_teacher

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama, a Qwen2 and a Qwen3 teacher (2 key/value heads, so TP=2 splits them) over 12 rows of 3
    agents."""
    root = tmp_path_factory.mktemp("megatron-precompute")
    tokenizer = make_tokenizer()
    teachers = {
        "math": save_teacher(
            root / "llama", "llama", hidden_size=64, seed=31, tokenizer=tokenizer, num_key_value_heads=2
        ),
        "code": save_teacher(
            root / "qwen2", "qwen2", hidden_size=64, seed=32, tokenizer=tokenizer, num_key_value_heads=2
        ),
        "chat": save_teacher(
            root / "qwen3", "qwen3", hidden_size=64, seed=33, tokenizer=tokenizer, num_key_value_heads=2
        ),
    }
    return routed_config(root, teachers)


def torchrun_precompute(
    config: Path,
    store: Path,
    *,
    nproc: int,
    tp: int,
    pp: int,
    sequence_parallel: bool = False,
    launcher: Callable[..., str] = run_mopd,
) -> str:
    """`mopd precompute --backend megatron` on `nproc` ranks (`launcher`: `run_mopd` or `run_torchrun`)."""
    raw = yaml.safe_load(config.read_text())
    raw["precompute"]["parallel"] = {"tp": tp, "pp": pp, "sequence_parallel": sequence_parallel}
    variant = store.with_suffix(".yaml")
    variant.write_text(yaml.safe_dump(raw))
    return launcher(
        ["precompute", str(variant), "--backend", "megatron", "--store", str(store)],
        nproc=nproc,
        env={"COLUMNS": "200"},  # progress and summary lines unwrapped
    )


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_megatron_store_equals_hf_store(config: Path, tmp_path: Path, tp: int, pp: int) -> None:
    reference = build(config, "hf", "float32")
    store = tmp_path / f"tp{tp}-pp{pp}.zarr"
    log = torchrun_precompute(config, store, nproc=2, tp=tp, pp=pp)
    assert log.count("manifest written") == 1  # one writer per group: the last stage's first TP rank
    assert_fp32_equal(reference, open_store(store), "megatron")
    again = torchrun_precompute(config, store, nproc=2, tp=tp, pp=pp)
    assert "computed 0 tasks, skipped 7 already done" in again


def test_world_not_divisible_by_the_teacher_layout(config: Path, tmp_path: Path) -> None:
    raw = yaml.safe_load(config.read_text())
    raw["precompute"]["parallel"] = {"tp": 2, "pp": 1}
    variant = tmp_path / "tp2.yaml"
    variant.write_text(yaml.safe_dump(raw))
    done = run_mopd_process(["precompute", str(variant), "--backend", "megatron"], cwd=REPO, timeout=120)
    assert done.returncode == 1
    assert "precompute.parallel tp=2 × pp=1 does not divide the 1 ranks" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # four ranks under the real launcher
def test_two_model_parallel_groups_share_the_tasks(config: Path, tmp_path: Path) -> None:
    """4 ranks at TP=2 with sequence parallelism (rows of odd and even lengths): two groups, each one
    job of the task split; together they write the hf store."""
    reference = build(config, "hf", "float32")
    store = tmp_path / "dp2.zarr"
    log = torchrun_precompute(
        config, store, nproc=4, tp=2, pp=1, sequence_parallel=True, launcher=run_torchrun
    )
    computed = [int(n) for n in re.findall(r"computed (\d+) tasks", log)]
    assert len(computed) == 2 and sum(computed) == 7 and min(computed) > 0  # two writers, disjoint shares
    # Both groups may finish their last task at once and both finalize: the manifest is published
    # no-clobber, so one wins, and only it says so; the other finds the identical manifest.
    assert log.count("manifest written") == 1
    assert_fp32_equal(reference, open_store(store), "megatron")


def test_an_int8_rotated_store_across_two_pipeline_stages(config: Path, tmp_path: Path) -> None:
    """Both stages run each teacher's calibration forwards (only the writer fits and publishes the
    encoding); every decoded state is the fp32 hf store's within the codes' rounding."""
    reference = build(config, "hf", "float32")
    raw = yaml.safe_load(config.read_text())
    raw["store"] = {**raw["store"], "dtype": "float32", "encoding": "int8-rotated"}
    coded_config = tmp_path / "int8.yaml"
    coded_config.write_text(yaml.safe_dump(raw))
    store = tmp_path / "int8.zarr"
    log = torchrun_precompute(coded_config, store, nproc=2, tp=1, pp=2)
    assert log.count("manifest written") == 1
    coded = open_store(store)
    assert [a.teacher for a in coded.manifest.encodings] == [0, 1, 2]
    for i in range(reference.num_rows):
        exact, decoded = reference.hidden(i), coded.hidden(i)
        encoding = coded.encoding(coded.row(i).teacher_index)
        assert encoding is not None
        _, scales = encoding[0].encode(exact)
        # Each rotated value is off by at most half its token's step s, so a token's state by s·√H/2;
        # the two backends' fp32 forwards differ by far less (`test_megatron_store_equals_hf_store`).
        bound = 0.5 * scales * exact.shape[1] ** 0.5 * 1.01 + 1e-4 * exact.norm(dim=1)
        assert bool(((decoded - exact).norm(dim=1) <= bound).all()), i

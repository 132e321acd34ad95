"""Acceptance: one vLLM engine over tp × pp workers writes the single-worker store.

A Llama (hidden 64) and a Qwen3 (hidden 128) teacher with 2 key/value heads of 32 (vLLM's CPU attention
needs heads of at least 32; tp = 2 splits them) and 2 blocks (pp = 2 gives each stage one). Tensor
parallelism splits each row-parallel product's sum over the workers, which changes its rounding: the
stores agree within `network_rtol`, the bound of one fp32 network computed two ways.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

from mopd.base.errors import ConfigError
from mopd.config.mopd_config import load_config
from mopd.precompute.runner import PrecomputeResult, run_precompute
from mopd.precompute.vllm_backend import engine_devices, environment
from mopd.store import TeacherStore, open_store
from tests.precompute.conftest import routed_config
from tests.precompute.stores import assert_fp32_equal, build
from tests.precompute.teachers import make_tokenizer, save_teacher

BIND = "VLLM_CPU_OMP_THREADS_BIND"


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vllm-parallel")
    tokenizer = make_tokenizer()
    teachers = {
        alias: save_teacher(
            root / arch,
            arch,
            hidden_size=hidden,
            seed=seed,
            tokenizer=tokenizer,
            head_dim=32,
            num_key_value_heads=2,
        )
        for alias, arch, hidden, seed in (("math", "llama", 64, 51), ("code", "qwen3", 128, 52))
    }
    return routed_config(root, teachers)


@pytest.fixture(scope="module")
def single(config: Path) -> TeacherStore:
    """The store of one single-worker engine per teacher."""
    return build(config, "vllm", "float32")


def run_jobs(
    config: Path, store: Path, *, tp: int, pp: int, jobs: int
) -> tuple[list[str], list[PrecomputeResult]]:
    """`jobs` precompute jobs (one after the other: this machine has 2 cores), each one tp × pp engine
    per teacher, over one store; (their log lines, their results)."""
    raw = yaml.safe_load(config.read_text())
    raw["precompute"]["parallel"] = {"tp": tp, "pp": pp}
    raw["store"]["path"] = str(store)
    variant = store.with_suffix(".yaml")
    variant.write_text(yaml.safe_dump(raw))
    lines: list[str] = []
    results = [
        run_precompute(
            load_config(variant),
            backend="vllm",
            num_tasks=jobs,
            task_index=index,
            show_progress=False,
            log=lines.append,
        )
        for index in range(jobs)
    ]
    return lines, results


@pytest.mark.slow
def test_two_jobs_at_tp2_give_the_single_worker_store(
    config: Path, single: TeacherStore, tmp_path: Path
) -> None:
    lines, results = run_jobs(config, tmp_path / "tp2.zarr", tp=2, pp=1, jobs=2)
    computed = [len(r.tasks_computed) for r in results]
    assert min(computed) > 0 and sum(computed) == results[0].tasks_total  # disjoint shares, all done
    assert results[-1].manifest is not None
    assert any("vLLM engine tp=2 × pp=1 on CPU cores 0|1" in line for line in lines), lines
    assert_fp32_equal(single, open_store(tmp_path / "tp2.zarr"), "vllm")
    assert BIND not in os.environ  # the binding was the engines' alone


@pytest.mark.slow
def test_pp2_gives_the_single_worker_store(config: Path, single: TeacherStore, tmp_path: Path) -> None:
    """Also the test of `allocate_stage_inputs`: without it the second stage fails its first batch."""
    lines, _ = run_jobs(config, tmp_path / "pp2.zarr", tp=1, pp=2, jobs=1)
    assert sum("vLLM engine tp=1 × pp=2" in line for line in lines) == 2, lines
    assert_fp32_equal(single, open_store(tmp_path / "pp2.zarr"), "vllm")


def test_engines_bind_workers_to_their_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv(BIND, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3, 4, 5, 6, 7})
    said, env = engine_devices(cpu, 2, 2)
    assert env == {BIND: "0,1|2,3|4,5|6,7"} and "tp=2 × pp=2 on CPU cores 0,1|2,3|4,5|6,7" in said
    assert engine_devices(cpu, 1, 1) == ("vLLM on the CPU", {})
    monkeypatch.setenv(BIND, "1|3")  # the user's own binding stands
    assert engine_devices(cpu, 2, 1)[1] == {BIND: "1|3"}
    with pytest.raises(ConfigError, match=r"tp=4 × pp=4 needs 16 CPU workers, but this process may use 8"):
        engine_devices(cpu, 4, 4)
    monkeypatch.delenv(BIND)
    with environment({BIND: "0|1"}):
        assert os.environ[BIND] == "0|1"
    assert BIND not in os.environ

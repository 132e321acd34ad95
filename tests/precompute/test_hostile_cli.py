"""Hostile input through the real CLI: hypothesis draws configs and dataset rows that the docs call
invalid, and `mopd precompute` runs each in process (exit code and output captured). Every one must end
in exit 1 (2 for click's own usage errors) with one `error:` line and no traceback, and write no
manifest: never a silent accept, never a crash.

The configs are a valid config with one to three of its values made invalid (a wrong type, a number out
of range, a word the key does not take, an unknown key, a missing required one) or raw text that is
not such a config at all; the datasets are valid rows of one format with one invalid row among them
(`docs/config.md`, `precompute/data.py`). Derandomized: every run draws the same examples.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mopd.cli.main import cli
from tests.precompute.teachers import make_tokenizer

CONFIGS = 1000
DATASETS = 500  # of 2 to 6 rows each: ~2,000 rows

# Values the docs call invalid for each key (a GPU device only where this machine has none).
_NO_GPU = [] if torch.cuda.is_available() else ["cuda", "cuda:0"]
BAD_VALUES: dict[tuple[str, ...], list[Any]] = {
    ("teachers",): [{}, [], "math", None, 3],
    ("teachers", "math"): ["", None, 7, True, [], "no/such/teacher"],
    ("tokenizer",): ["", 5, True, "no/such/tokenizer"],
    ("data",): [5, [], "data.jsonl", None],
    ("data", "path"): ["", 7, None, True, [], "missing.jsonl", "data.csv"],
    ("data", "max_length"): [True, False, "96", 1.5, -1, 0, None, [96], {"n": 1}],
    ("data", "overlong"): ["cut", "", 1, None, True],
    ("data", "num_proc"): [0, -1, True, "2", 1.5],
    ("store",): [3, [], "out"],
    ("store", "path"): ["", True, 3, None],
    ("store", "dtype"): ["float16", "fp8", 1, None, True],
    ("store", "codec"): ["zstd", "", 0, None],
    ("precompute", "rows_per_task"): [0, -3, True, "3", 2.5, None],
    ("precompute", "batch_tokens"): [0, -1, False, "256", 2.5],
    ("precompute", "dtype"): ["half", 16, True, None],
    ("precompute", "device"): ["banana", "cuda:7", "cuda:-1", "", 0, "CPU", "gpu", *_NO_GPU],
    ("precompute", "trust_remote_code"): ["yes", 1, "true", None, 0.0],
    ("precompute", "backend"): ["tensorrt", "", 1, None],
    ("precompute", "parallel"): [2, "tp=2", {"tp": 0}, {"tp": True}, {"pp": -1}, {"tp": 2}],
    ("routing",): [[], "agent", 1],
    ("routing", "field"): [1, None, [], {"a": 1}, "no_such_column"],
    ("routing", "default_teacher"): ["nobody", 1, "", True],
    ("routing", "teacher_by_agent"): [[], "math", {"math": "nobody"}, {"math": 1}, {"math": None}],
    ("train", "seed"): [-1, 2**70, True, "1", 1.5],
    ("train", "steps"): [0, -1, True, "5"],
}
UNKNOWN_KEYS = [("data", "max_len"), ("store", "compression"), ("precompute", "batch"), ("nonsense",)]
REQUIRED = [("teachers",), ("data", "path")]
NOT_CONFIGS = [
    b"",
    b"- a\n- list\n",
    b"just a string",
    b"teachers: {math: a}\nteachers: {code: b}\n",  # a repeated key
    b"a: &x [1]\nb: *x\n",  # an alias
    b"data:\n\t- tab\n",
    b"\xff\xfe not text",
    b"{unclosed: [",
]


def hostile(examples: int) -> Any:
    """Hypothesis settings of this harness: the same `examples` examples every run, however slow."""
    return settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def _set(raw: dict[str, Any], path: tuple[str, ...], value: Any, *, delete: bool = False) -> None:
    node = raw
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    if delete:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value


_mutation = st.one_of(
    st.sampled_from([(path, value) for path, values in BAD_VALUES.items() for value in values]),
    st.sampled_from([(path, "surprise") for path in UNKNOWN_KEYS]),
    st.sampled_from([(path, None, "delete") for path in REQUIRED]),
)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, tiny_teachers: dict[str, Path]) -> dict[str, Any]:
    """A valid config (it precomputes) over a small valid dataset, as a dict to mutate."""
    root = tmp_path_factory.mktemp("hostile")
    data = root / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"agent": a, "text": f"{a} row {i}"}) + "\n" for i, a in enumerate("mc"))
    )
    raw = {
        "teachers": {"math": str(tiny_teachers["llama"]), "code": str(tiny_teachers["qwen2"])},
        "routing": {"teacher_by_agent": {"m": "math", "c": "code"}},
        "data": {"path": str(data), "max_length": 32},
        "store": {"path": str(root / "valid.zarr"), "dtype": "float32"},
        "precompute": {"rows_per_task": 4, "batch_tokens": 256, "dtype": "float32", "device": "cpu"},
        "train": {"student": str(tiny_teachers["llama"]), "steps": 1},
    }
    config = root / "valid.yaml"
    config.write_text(yaml.safe_dump(raw))
    refused_or_done(config, valid=True)
    return raw


def refused_or_done(config: Path, *, valid: bool = False) -> str:
    """Runs `mopd precompute CONFIG` in process; asserts a clean refusal (or, `valid`, success)."""
    result = CliRunner().invoke(cli, ["precompute", str(config)], catch_exceptions=True)
    output = result.output
    assert "Traceback" not in output and not isinstance(result.exception, AssertionError), output
    if valid:
        assert result.exit_code == 0, output
        return output
    assert result.exit_code in (1, 2), f"exit {result.exit_code} on an invalid input:\n{output}"
    if result.exit_code == 1:
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, output
        return errors[0]
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return output


@hostile(CONFIGS)
@given(
    mutations=st.lists(_mutation, min_size=1, max_size=3),
    not_config=st.one_of(st.none(), st.sampled_from(NOT_CONFIGS)),
)
def test_no_invalid_config_is_accepted_or_crashes(
    base: dict[str, Any], tmp_path: Path, mutations: list[tuple[Any, ...]], not_config: bytes | None
) -> None:
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    config = work / "config.yaml"
    if not_config is not None:
        config.write_bytes(not_config)
    else:
        raw = json.loads(json.dumps(base))
        raw["store"]["path"] = str(work / "store.zarr")
        for path, value, *delete in mutations:
            _set(raw, path, value, delete=bool(delete))
        config.write_text(yaml.safe_dump(raw))
    refused_or_done(config)
    assert not (work / "store.zarr" / "manifest.json").exists()


VOCAB = len(make_tokenizer())
_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)
_not_text = st.one_of(
    st.none(), st.integers(), st.floats(allow_nan=False), st.booleans(), st.lists(st.integers(), max_size=3)
)
_bad_id = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=VOCAB, max_value=2**62),
    st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x != int(x)),
    st.text(max_size=3),
    st.none(),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=2),
)
_bad_mask_value = st.one_of(st.integers(2, 9), st.integers(-9, -1), st.sampled_from([0.5, "1", None]))


def _good(fmt: str, i: int) -> dict[str, Any]:
    agent = "m" if i % 2 else "c"
    if fmt == "text":
        return {"agent": agent, "text": f"a good row {i}"}
    if fmt == "prompt+completion":
        return {"agent": agent, "prompt": f"question {i}", "completion": f"answer {i}"}
    if fmt == "messages":
        return {
            "agent": agent,
            "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}],
        }
    ids = [(7 * i + k) % VOCAB for k in range(5)]
    return {"agent": agent, "input_ids": ids, "loss_mask": [1, 1, 1, 1, 0]}


@st.composite
def _bad_row(draw: st.DrawFn, fmt: str) -> dict[str, Any] | bytes:
    """A row that the docs call invalid in a dataset of format `fmt` (or raw bytes that are not a row)."""
    row = _good(fmt, 0)
    kind = draw(st.sampled_from(["value", "routing", "format", "bytes"]))
    if kind == "routing":
        return (
            {**row, "agent": draw(st.sampled_from(["nobody", "", "M"]))}
            if draw(st.booleans())
            else {k: v for k, v in row.items() if k != "agent"}
        )
    if kind == "bytes":
        return b'{"agent": "m", "text": "caf' + draw(st.sampled_from([b"\xe9", b"\xff", b"\xc3("])) + b'"}'
    if kind == "format":  # a row of another format in this dataset
        others = [f for f in ("text", "prompt+completion", "messages", "input_ids") if f != fmt]
        other = _good(draw(st.sampled_from(others)), 1)
        return {k: v for k, v in other.items() if k not in row or k == "agent"}
    if fmt == "text":
        return {**row, "text": draw(_not_text)}
    if fmt == "prompt+completion":
        key = draw(st.sampled_from(["prompt", "completion"]))
        return (
            {**row, key: draw(_not_text)}
            if draw(st.booleans())
            else {k: v for k, v in row.items() if k != key}
        )
    if fmt == "messages":
        turn = draw(
            st.one_of(
                _not_text,
                st.fixed_dictionaries({"role": _not_text, "content": _text}),
                st.fixed_dictionaries({"role": st.just("user"), "content": _not_text}),
            )
        )
        return {
            **row,
            "messages": draw(st.sampled_from([turn, [turn], [{"role": "user", "content": "q"}, turn], []])),
        }
    ids = list(row["input_ids"])
    if draw(st.booleans()):
        ids[draw(st.integers(0, len(ids) - 1))] = draw(_bad_id)
        return {**row, "input_ids": ids}
    mask = list(row["loss_mask"])
    if draw(st.booleans()):
        mask[draw(st.integers(0, len(mask) - 1))] = draw(_bad_mask_value)
    else:
        mask = mask[: draw(st.integers(0, len(mask) - 1))] if draw(st.booleans()) else [*mask, 1]
    return {**row, "loss_mask": mask}


@st.composite
def _dataset(draw: st.DrawFn) -> list[dict[str, Any] | bytes]:
    fmt = draw(st.sampled_from(["text", "prompt+completion", "messages", "input_ids"]))
    rows: list[dict[str, Any] | bytes] = [_good(fmt, i) for i in range(draw(st.integers(1, 5)))]
    rows.insert(draw(st.integers(0, len(rows))), draw(_bad_row(fmt)))
    return rows


@pytest.mark.slow  # 500 datasets through the real CLI: 20-30 s
@hostile(DATASETS)
@given(rows=_dataset())
def test_no_invalid_row_is_accepted_or_crashes(base: dict[str, Any], tmp_path: Path, rows: list[Any]) -> None:
    tmp_path = Path(tempfile.mkdtemp(dir=tmp_path))
    data = tmp_path / "data.jsonl"
    data.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    raw = json.loads(json.dumps(base))
    raw["data"]["path"], raw["store"]["path"] = str(data), str(tmp_path / "store.zarr")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    error = refused_or_done(config)
    assert "row" in error or "line" in error or "data.path" in error, error
    assert not (tmp_path / "store.zarr" / "manifest.json").exists()

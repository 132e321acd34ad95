"""Parsers hold against hostile input: the config loader and the manifest, plan, part-record and
checkpoint readers refuse duplicate keys, NaN and Infinity, wrong types and oversized or deeply nested
files with their own one-line error, and fuzzing (10,000 examples per reader, derandomized so that CI
is repeatable) raises nothing else."""

from __future__ import annotations

import json
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mopd.base.completion import COMPLETE, read_complete
from mopd.base.errors import CheckpointError, ConfigError, ManifestError
from mopd.base.jsonio import MAX_DEPTH
from mopd.config.mopd_config import parse_config, parse_yaml
from mopd.store.format.manifest import parse_manifest, parse_part, parse_plan
from mopd.store.format.teachers import TEACHER_LIST_FILE, read_teacher_list
from mopd.train.checkpoint.state import read_state
from tests.store.synthetic import StoreSpec

FUZZ = settings(
    max_examples=10_000,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def mutations(valid: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """A valid record with one field, at any depth, replaced by another JSON value or removed."""
    paths: list[tuple[Any, ...]] = []

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        paths.append(path)
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, (*path, key))
        elif isinstance(node, list):
            for i, value in enumerate(node[:3]):
                walk(value, (*path, i))

    walk(valid, ())

    def mutate(path: tuple[Any, ...], value: Any, remove: bool) -> bytes:
        record = json.loads(json.dumps(valid))
        if not path:
            return json.dumps(value).encode()
        parent = record
        for key in path[:-1]:
            parent = parent[key]
        if remove and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
        return json.dumps(record).encode()  # Python writes NaN and Infinity as bare words

    return st.builds(mutate, st.sampled_from(paths[1:] or [()]), json_values, st.booleans())


def hostile_texts(valid: bytes) -> st.SearchStrategy[bytes]:
    """Raw bytes, truncations, duplicate keys, NaN/Infinity constants and deep nesting."""
    text = valid.decode()
    return st.one_of(
        st.binary(max_size=200),
        st.integers(min_value=0, max_value=len(valid)).map(lambda n: valid[:n]),
        st.sampled_from(
            [
                text.replace("{", '{"format": "mopd-teacher-store", ', 1).encode(),  # a repeated key
                text.replace("{", '{"x": NaN, ', 1).encode(),
                text.replace("{", '{"x": -Infinity, ', 1).encode(),
                ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)).encode(),
                ("[" * 100_000).encode(),
                b'"' + b"a" * 100 + b'"',
            ]
        ),
    )


def refuses_only_with(error: type[Exception], parse: Callable[[bytes], Any]) -> Callable[[bytes], None]:
    def check(data: bytes) -> None:
        try:
            parse(data)
        except error as err:
            assert "\n" not in str(err).strip(), str(err)  # one line
        except Exception as err:  # anything else escaped the reader
            raise AssertionError(f"{type(err).__name__}: {err}") from err

    return check


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The records of a real store (manifest, plan, one part record)."""
    from tests.store.synthetic import build_store, make_checkpoint

    root = tmp_path_factory.mktemp("hostile")
    a = make_checkpoint(root / "ckpt" / "a", hidden_size=16, seed=1)
    b = make_checkpoint(root / "ckpt" / "b", hidden_size=8, seed=2)
    spec = StoreSpec(
        root=str(root / "store.zarr"),
        teachers={"x": str(a), "y": str(b)},
        hidden_sizes={str(a): 16, str(b): 8},
        agents=["x", "y", "x"],
        lengths=[3, 4, 5],
    )
    build_store(spec)
    store = Path(spec.root)
    return {
        "manifest": (store / "manifest.json").read_bytes(),
        "plan": (store / "_plan.json").read_bytes(),
        "part": next((store / "_parts").glob("teacher_000_lm_head.json")).read_bytes(),
    }


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["manifest", "plan", "part"])
def test_store_records(records: dict[str, bytes], kind: str) -> None:
    parse = {"manifest": parse_manifest, "plan": parse_plan, "part": parse_part}[kind]
    check = refuses_only_with(ManifestError, lambda data: parse(data, Path(kind)))
    check(records[kind])  # the valid record parses
    parse(records[kind], Path(kind))
    valid = json.loads(records[kind])
    FUZZ(given(st.one_of(mutations(valid), hostile_texts(records[kind])))(check))()


VALID_CONFIG = b"""
teachers: {math: /ckpt/math, code: /ckpt/code}
routing: {field: agent}
data: {path: data.jsonl, max_length: 128}
train:
  student: /ckpt/student
  divergence: {kind: jsd, beta: 0.5}
  teacher_weights: {code: 2.0}
  batch: {micro_batch_tokens: 256, global_batch_tokens: 1024}
"""


@pytest.mark.slow
def test_config_loader() -> None:
    def parse(data: bytes) -> None:
        parse_config(parse_yaml(data, source="fuzz.yaml"), base_dir="/", source="fuzz.yaml")

    parse(VALID_CONFIG)
    check = refuses_only_with(ConfigError, parse)
    import yaml

    valid = yaml.safe_load(VALID_CONFIG)
    yaml_texts = st.one_of(
        st.text(alphabet=string.printable, max_size=200).map(str.encode),
        mutations(valid),  # JSON is YAML
        st.sampled_from(
            [
                VALID_CONFIG.replace(b"routing:", b"teachers: {a: /x}\nrouting:"),  # a duplicate key
                VALID_CONFIG.replace(b"beta: 0.5", b"beta: .nan"),
                VALID_CONFIG.replace(b"code: 2.0}", b"code: .inf}"),
                b"a: &x [1]\nb: [*x, *x]\n",  # an alias
                b"[" * 5000,
                b"x: " + b"[" * 2000 + b"]" * 2000,
                b"? [a, b]\n: c\n",  # a complex key
                b"teachers: " + b"y" * (2 << 20),
            ]
        ),
    )
    FUZZ(given(yaml_texts)(check))()


def _write_and(name: str, read: Callable[[Path], Any], folder: Path) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        (folder / name).write_bytes(data)
        return read(folder)

    return parse


VALID_STATE = {
    "step": 3,
    "loader": {"seed": 0, "epoch": 0, "step_in_epoch": 3},
    "param_groups": [{"lr": 0.001, "betas": [0.9, 0.999], "params": [0, 1]}],
    "scheduler": {"base_lrs": [0.001], "last_epoch": 3, "_step_count": 4},
    "layout": {"backend": "hf"},
    "run": {"train.seed": 0},
}


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["state", "teacher list", "marker"])
def test_checkpoint_readers(tmp_path: Path, reader: str) -> None:
    (tmp_path / COMPLETE).write_text(json.dumps({"step": 3, "files": {}}))
    name, read, error, valid = {
        "state": ("state.json", read_state, CheckpointError, VALID_STATE),
        "teacher list": (
            TEACHER_LIST_FILE,
            read_teacher_list,
            ManifestError,
            {"teachers": [{"index": 0, "checkpoint": "/a", "fingerprint": "f" * 64}]},
        ),
        "marker": (
            COMPLETE,
            read_complete,
            CheckpointError,
            {"step": 3, "files": {"state.json": [10, "0" * 64]}},
        ),
    }[reader]
    parse = _write_and(name, read, tmp_path)
    parse(json.dumps(valid).encode())
    data = json.dumps(valid).encode()
    FUZZ(given(st.one_of(mutations(valid), hostile_texts(data)))(refuses_only_with(error, parse)))()

"""A config means what it says: no YAML boolean is read as a number or a string as a boolean, no path is
empty, devices and seeds are checked; each refusal is one line naming the key (issue 30)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from mopd.base.errors import ConfigError
from mopd.cli.main import cli
from mopd.config.mopd_config import load_config

BASE = """\
teachers:
  math: ckpts/math
  code: ckpts/code
"""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("data: {path: d.jsonl, max_length: true}", "`data.max_length`: true is a boolean"),
        (
            "data: {path: d.jsonl}\nprecompute: {trust_remote_code: 'yes'}",
            "`precompute.trust_remote_code`: expected true or false, got 'yes'",
        ),
        (
            "data: {path: d.jsonl}\nprecompute: {trust_remote_code: 1}",
            "`precompute.trust_remote_code`: expected true or false, got 1",
        ),
        (
            "data: {path: d.jsonl}\ntrain: {student: s, teacher_weights: {math: true}}",
            "`train.teacher_weights`: math: true is a boolean",
        ),
        (
            "data: {path: d.jsonl}\ntrain: {student: s, seed: '1'}",
            "`train.seed`: '1' is text, not a number (write it without quotes)",
        ),
        ("data: {path: d.jsonl, max_length: '96'}", "`data.max_length`: '96' is text, not a number"),
        ("data: {path: d.jsonl}\nstore: {path: ''}", "`store.path`: String should have at least 1 character"),
        ("data: {path: ''}", "`data.path`: String should have at least 1 character"),
        (
            "data: {path: d.jsonl}\ntrain: {student: ''}",
            "`train.student`: String should have at least 1 character",
        ),
        (
            "data: {path: d.jsonl}\ntrain: {student: s, seed: -1}",
            "`train.seed`: Input should be greater than or equal to 0",
        ),
        (
            "data: {path: d.jsonl}\ntrain: {student: s, seed: 1180591620717411303424}",
            "`train.seed`: Input should be less than",
        ),
        (
            "data: {path: d.jsonl}\ntrain: {student: s, device: banana}",
            "`train.device`: 'banana' is not a device",
        ),
        (
            "data: {path: d.jsonl}\nprecompute: {device: 'cuda:x'}",
            "`precompute.device`: 'cuda:x' is not a device",
        ),
        (
            "data: {path: d.jsonl}\nrollout: {prompts: p.jsonl, device: gpu}",
            "`rollout.device`: 'gpu' is not a device",
        ),
    ],
)
def test_a_lax_value_is_refused_naming_its_key(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(BASE + text + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert message in str(err.value) and "\n" not in str(err.value)
    out = CliRunner().invoke(cli, ["precompute", str(config)])  # the command: exit 1, one line
    assert out.exit_code == 1 and message in out.output and "Traceback" not in out.output


def test_the_empty_path_is_not_the_config_folder(tmp_path: Path) -> None:
    """An empty path was resolved to the config's own folder, so a store was written there."""
    config = tmp_path / "config.yaml"
    config.write_text(BASE + "data: {path: d.jsonl}\nstore: {path: ''}\n")
    with pytest.raises(ConfigError, match=r"store\.path"):
        load_config(config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_booleans_and_numbers_of_the_right_type_still_load(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        BASE + "data: {path: d.jsonl, max_length: 64}\nprecompute: {trust_remote_code: false}\n"
        "train: {student: s, optim: {lr: 1e-4}, teacher_weights: {math: 2}, device: 'cuda:1', seed: 7}\n"
    )
    loaded = load_config(config)
    assert loaded.train is not None and loaded.train.optim.lr == 1e-4  # YAML 1.1 reads 1e-4 as a string
    assert loaded.train.teacher_weights == {"math": 2.0} and loaded.train.device == "cuda:1"

"""Command-line overrides (`key.path=value` after CONFIG): read as YAML values, validated by the config's
own models, one line naming the key when wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from mopd.base.errors import ConfigError
from mopd.config.mopd_config import load_config
from mopd.config.overrides import apply_overrides
from tests.config.test_config import BASE, write

TRAIN = BASE + "train: {student: s, steps: 10, optim: {lr: 1.0e-4}}\n"


@pytest.mark.parametrize(
    ("override", "read"),
    [
        ("train.steps=50", lambda c: c.train.steps == 50),  # int
        ("train.optim.lr=3e-5", lambda c: c.train.optim.lr == 3e-5),  # float, YAML 1.2 exponent
        ("train.backend=fsdp", lambda c: c.train.backend == "fsdp"),  # text
        ("data.max_length=96", lambda c: c.data.max_length == 96),  # a section the file sets
        ("train.parallel.dp_replicate=1", lambda c: c.train.parallel.dp_replicate == 1),  # a new section
        (  # a mapping replaces the section (here, one the file does not set)
            "train.batch={micro_batch_tokens: 256, global_batch_tokens: 1024}",
            lambda c: (c.train.batch.micro_batch_tokens, c.train.batch.global_batch_tokens) == (256, 1024),
        ),
        ("train.eval.rows=0", lambda c: c.train.eval.rows == 0),
        ("train.teacher_weights={math: 2.0, code: 1.0}", lambda c: c.train.teacher_weights["math"] == 2.0),
    ],
)
def test_each_kind_of_value_is_set(tmp_path: Path, override: str, read: object) -> None:
    config = load_config(write(tmp_path, TRAIN), [override])
    assert read(config)  # type: ignore[operator]


def test_a_list_value_and_the_last_override_wins(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, TRAIN), ["train.steps=5", "train.steps=7"])
    assert config.train is not None and config.train.steps == 7
    # A list is read as one (no setting takes one yet: shown on the document the models validate).
    raw = apply_overrides({"train": {"steps": 1}}, ["train.report_to=[tensorboard, '###']"])
    assert raw == {"train": {"steps": 1, "report_to": ["tensorboard", "###"]}}


def test_a_relative_path_is_relative_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path typed on the command line means the shell's folder; the file's paths stay the config's."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    config = load_config(write(tmp_path / "configs", TRAIN), ["train.output_dir=runs/a"])
    assert config.train is not None and config.train.output_dir == str(tmp_path / "work" / "runs" / "a")
    assert config.data.path == str(tmp_path / "configs" / "data" / "train.jsonl")
    # A checkpoint that names no folder here stays an identifier (the config's rules for it apply).
    config = load_config(write(tmp_path / "configs", TRAIN), ["train.student=org/model"])
    assert config.train is not None and config.train.student == "org/model"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "train.stepz=5",
            r"^command line train.stepz=5: train has no key stepz; did you mean train.steps\?$",
        ),
        (
            "train.steps=many",
            r"^command line train.steps=many: `train.steps`: 'many' is text, not a number \(write a number, "
            r"e.g. 5000 or 3e-4\)$",
        ),
        ("train.steps=-1", r"`train.steps`: Input should be greater than"),
        (  # a union's members each refuse it: one part, the key named once
            "train.divergence.chunk_size=5k",
            r"^command line train.divergence.chunk_size=5k: `train.divergence.chunk_size`: Input should be a "
            r"valid integer, unable to parse string as an integer or Input should be 'auto'$",
        ),
        ("train.optim.lr=[1, 2]", r"`train.optim.lr`: Input should be a valid number"),
        ("train.steps", r"override 'train.steps': write it as section.key=value"),
        ("train..steps=1", r"override 'train..steps=1': write it as section.key=value"),
        ("train.steps.max=1", r"override train.steps.max: train.steps is 10 in the config, not a section"),
        ("train.steps={a: [}", r"override train.steps: not valid YAML"),
    ],
)
def test_a_bad_override_is_one_line_naming_the_key(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(write(tmp_path, TRAIN), [override])
    assert "\n" not in str(raised.value)

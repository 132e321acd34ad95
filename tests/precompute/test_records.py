"""A JSON file is checked in blocks before `datasets` parses it: bytes that are not UTF-8, a JSON Lines
line over the limit and a file without rows are refused naming the key, the file and the line; the
check holds wherever a block boundary falls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mopd.base.errors import ConfigError
from mopd.precompute import records
from mopd.precompute.records import MAX_LINE_BYTES, check_json_text, load_records

LINES = ["short", "a line of 30 characters ......", "é" * 7, "x"]  # "é" is 2 bytes: 14 bytes


@pytest.mark.parametrize("block", [1, 2, 3, 7, 64, 1 << 20])
def test_lines_are_measured_across_block_boundaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    """With blocks of 1 byte upwards (a 2-byte character split between blocks too), valid UTF-8 passes,
    and the first line over the limit is the one named."""
    monkeypatch.setattr(records, "_BLOCK_BYTES", block)
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    check_json_text(path, "data.path", lines=True, limit=30)
    with pytest.raises(ConfigError, match=r"^data.path .*d.jsonl: line 2 is longer than"):
        check_json_text(path, "data.path", lines=True, limit=29)
    with pytest.raises(ConfigError, match=r"line 3 is longer than"):
        path.write_text("\n".join(["a", "b", "é" * 7, "c"]), encoding="utf-8")
        check_json_text(path, "data.path", lines=True, limit=13)
    path.write_text("no newline at the end", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"line 1 is longer than"):
        check_json_text(path, "data.path", lines=True, limit=20)
    check_json_text(path, "data.path", lines=False, limit=20)  # a JSON document is one value, not lines


@pytest.mark.parametrize("block", [1, 5, 1 << 20])
@pytest.mark.parametrize(
    ("data", "line", "column"),
    [
        (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', 2, 13),  # latin-1, not UTF-8
        (b'{"text": "\xff"}\n', 1, 10),
        (b'{"text": "a"}\n\n{"text": "b\xc3"}\n', 3, 11),  # a 2-byte character cut short
    ],
)
def test_bytes_that_are_not_utf8_name_the_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int, data: bytes, line: int, column: int
) -> None:
    monkeypatch.setattr(records, "_BLOCK_BYTES", block)
    path = tmp_path / "d.jsonl"
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=rf": line {line} is not UTF-8 text \(.* byte {column} of the line"):
        check_json_text(path, "rollout.prompts", lines=True)


def test_a_file_cut_inside_a_character_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes('{"text": "é"}\n'.encode()[:-4])
    with pytest.raises(ConfigError, match="line 1 is not UTF-8 text"):
        check_json_text(path, "data.path", lines=True)


@pytest.mark.parametrize("content", [b"", b"\n\n", b"  \n\t\n"])
def test_a_file_without_rows_says_so(tmp_path: Path, content: bytes) -> None:
    """An empty file (which `datasets` fails on with a bare StopIteration) holds no rows."""
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=rf"^rollout.prompts {path} holds no rows$"):
        load_records(path, key="rollout.prompts")


def test_a_line_over_the_limit_is_refused_before_datasets_parses_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets

    path = tmp_path / "d.jsonl"
    with path.open("w") as f:
        f.write(json.dumps({"text": "fine"}) + "\n")
        f.write(json.dumps({"text": "word " * (MAX_LINE_BYTES // 5)}) + "\n")
    parsed: list[object] = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: parsed.append(args))
    with pytest.raises(ConfigError, match=r"line 2 is longer than 8 MiB, the most a JSON Lines row may hold"):
        load_records(path)
    assert parsed == []

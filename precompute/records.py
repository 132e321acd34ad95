"""Reading a dataset file or folder with HF `datasets`, JSON files checked before any parser sees them.

A JSON Lines row is parsed whole and then tokenised whole before any length limit can apply, and the
tokenizer's memory grows by hundreds of bytes per byte of text: one runaway line (a file concatenated
without newlines, a base64 blob) would take the machine down instead of failing. So a JSON file is read
once in blocks first: bytes that are not UTF-8, and in a JSON Lines file a line over `MAX_LINE_BYTES`,
are refused with the line's number, in bounded memory, before `datasets` opens it.
"""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any

import numpy as np

from mopd.base.errors import ConfigError

# ~2M tokens of text at ~4 bytes a token: past any teacher's context, so no row this long can train.
MAX_LINE_BYTES = 8 << 20
_BLOCK_BYTES = 8 << 20


def check_json_text(path: Path, key: str, *, lines: bool, limit: int = MAX_LINE_BYTES) -> None:
    """The file is UTF-8 and holds a row; with `lines` (JSON Lines) no line is longer than `limit`.

    Raises:
        ConfigError: naming `key`, the file and the line.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    line, line_start, read, blank = 1, 0, 0, True  # the current line, where it starts; bytes read
    with path.open("rb") as f:
        while block := f.read(_BLOCK_BYTES):
            pending = len(decoder.getstate()[0])  # a character's first bytes, from the block before
            try:
                decoder.decode(block)
            except UnicodeDecodeError as err:
                at = max(0, err.start - pending)  # within the block (the pending bytes are on this line)
                newline = block.rfind(b"\n", 0, at)
                start = read + newline + 1 if newline >= 0 else line_start
                bad_line = line + block.count(b"\n", 0, at)
                raise ConfigError(
                    f"{key} {path}: line {bad_line} is not UTF-8 text ({err.reason} at byte "
                    f"{read + err.start - pending - start} of the line); re-encode the file as UTF-8"
                ) from None
            blank = blank and not block.strip()
            ends = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == ord("\n")) + read
            lengths = np.diff(ends, prepend=line_start - 1) - 1  # of the lines that end in this block
            read += len(block)
            if lines and (lengths > limit).any():
                raise ConfigError(_too_long(key, path, line + int(np.argmax(lengths > limit)), limit))
            if lines and read - (int(ends[-1]) + 1 if ends.size else line_start) > limit:
                raise ConfigError(_too_long(key, path, line + ends.size, limit))
            line, line_start = line + ends.size, int(ends[-1]) + 1 if ends.size else line_start
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:
        raise ConfigError(f"{key} {path}: line {line} is not UTF-8 text ({err.reason}, at its end)") from None
    if blank:
        raise ConfigError(f"{key} {path} holds no rows")


def _too_long(key: str, path: Path, line: int, limit: int) -> str:
    return (
        f"{key} {path}: line {line} is longer than {limit >> 20} MiB, the most a JSON Lines row may hold "
        "(no row that long fits a teacher's context); split or shorten it"
    )


def load_records(path: str | Path, *, key: str = "data.path") -> Any:
    """Loads a dataset file or folder with HF `datasets` (no network); `key` is the config key that
    named it, which errors name.

    Raises:
        ConfigError: the path is missing, not a format `datasets` reads, holds no rows or (JSON) bytes
            that are not UTF-8 or a line too long.
    """
    import datasets

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{key} {path} does not exist")
    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            return loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded
        suffix = path.suffix.lower()
        builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}.get(suffix)
        if builder is None:
            raise ConfigError(
                f"{key} {path}: unknown file type {suffix!r}; use .jsonl, .json, .parquet, "
                ".arrow or a folder written by Dataset.save_to_disk"
            )
        if builder == "arrow":
            return datasets.Dataset.from_file(str(path))
        if builder == "json":
            check_json_text(path, key, lines=suffix == ".jsonl")
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except ConfigError:
        raise
    except ValueError as err:
        if "corresponds to no data" in str(err):  # datasets' way of saying the file has no rows
            raise ConfigError(f"{key} {path} holds no rows") from err
        raise ConfigError(f"{key} {path}: cannot be read as a dataset ({err})") from err
    except Exception as err:
        raise ConfigError(f"{key} {path}: cannot be read as a dataset ({type(err).__name__}: {err})") from err

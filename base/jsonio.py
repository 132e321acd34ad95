"""Strict JSON for every record mopd reads back: manifest, plan, part records, checkpoint state.

Python's `json` accepts what these records must never hold: a repeated key (the last silently wins,
which could quietly swap a teacher or a hash), `NaN` and `Infinity` (not JSON, and never a valid count
or hash), files of any size and nesting deep enough to exhaust the stack. `parse_json` refuses all of
them with one `MopdError` subclass naming the file, so a damaged or hostile record is reported, never
half-trusted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from mopd.base.errors import MopdError

Model = TypeVar("Model", bound=BaseModel)

MAX_RECORD_BYTES = 64 << 20  # a manifest of 1M shards is ~400 MB; 64 MiB covers ~150k shards
MAX_DEPTH = 32  # the deepest record mopd writes nests 6 levels


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def _depth(text: str) -> int:
    """Bracket nesting depth outside strings (a cheap pre-check: `json` recurses once per level).

    Strings are blanked first (in C, by the regex engine), so the loop runs over brackets only: a
    store's 10k part records and 30k array headers are each checked in microseconds."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRING.sub('""', text)):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def decode_text(data: bytes, *, what: str, error: type[MopdError], max_bytes: int) -> str:
    """`data` as UTF-8 text of at most `max_bytes` bytes (else `error`, naming `what`)."""
    if len(data) > max_bytes:
        raise error(f"{what}: {len(data)} bytes, more than the {max_bytes} it may have; it is damaged")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{what}: not UTF-8 text ({err}); it is damaged") from err


def parse_json(data: bytes, *, what: str, error: type[MopdError], max_bytes: int = MAX_RECORD_BYTES) -> Any:
    """Parses `data` strictly.

    Raises:
        `error`: naming `what`, for oversized input, invalid UTF-8 or JSON, duplicate keys, NaN or
            Infinity, or nesting deeper than MAX_DEPTH.
    """
    text = decode_text(data, what=what, error=error, max_bytes=max_bytes)
    # Fewer brackets than the limit cannot nest deeper than it (most records: no scan at all).
    if text.count("[") + text.count("{") > MAX_DEPTH and _depth(text) > MAX_DEPTH:
        raise error(f"{what}: nested more than {MAX_DEPTH} levels deep; it is damaged")
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except ValueError as err:
        raise error(f"{what}: does not parse as JSON ({err}); it is damaged") from err
    if "\\u" in text:  # a lone surrogate can only come from a \u escape
        check_unicode(value, what=what, error=error)
    return value


def check_unicode(value: Any, *, what: str, error: type[MopdError]) -> None:
    """Refuses strings holding lone UTF-16 surrogates (a `\\ud800` escape decodes to one; no text can
    hold it, and code that encodes it fails far from here)."""
    try:
        json.dumps(value, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError as err:
        raise error(f"{what}: holds an escaped lone surrogate, which is not text; it is damaged") from err


def read_json(path: Path, *, what: str, error: type[MopdError], max_bytes: int = MAX_RECORD_BYTES) -> Any:
    """`parse_json` of a file (FileNotFoundError passes through: a missing record is not a bad one).

    Raises:
        `error`: as `parse_json`, or when the file cannot be read.
    """
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise error(f"{what} {path}: {size} bytes, more than the {max_bytes} a record may have")
        data = path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as err:
        raise error(f"{what} {path}: unreadable ({err.strerror})") from err
    return parse_json(data, what=f"{what} {path}", error=error, max_bytes=max_bytes)


def describe_location(loc: tuple[object, ...]) -> str:
    """A pydantic error location as `a.b.0.c`, with odd keys (spaces, newlines, empty) quoted."""
    parts = [str(p) if str(p).isidentifier() or isinstance(p, int) else ascii(str(p)) for p in loc]
    return ".".join(parts) or "(top level)"


def validated(model: type[Model], raw: Any, *, what: str, error: type[MopdError]) -> Model:
    """`raw` as a `model`, or `error` in one line, `<what>: <field>: <why>`, for the first field that does
    not fit."""
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        raise error(f"{what}: {describe_location(first['loc'])}: {first['msg']}") from err

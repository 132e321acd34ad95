"""pydantic's validation errors as a user reads them: the dotted key, where its value was set (the file or
the command line), and for an unknown key the closest keys the section has."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from mopd.base.jsonio import describe_location


def explain(
    err: ValidationError, model: type[BaseModel], *, source: str, overrides: Mapping[str, str]
) -> str:
    """One problem per `; `-separated part: `<source>: `key`: why` for a value from the file,
    `command line key=value: `key`: why` for one an override set (`overrides`: dotted key → the text
    typed). Errors a union gives once per member (`chunk_size: 5k` is neither a number nor "auto") are
    one part."""
    by_key: dict[tuple[Any, ...], list[str]] = {}
    unknown: set[tuple[Any, ...]] = set()
    for item in err.errors():
        loc = _field_path(model, item["loc"])
        message = " ".join(item["msg"].removeprefix("Value error, ").split())
        if item["type"] == "extra_forbidden":
            message = _unknown_key(model, loc)
            unknown.add(loc)
        if message not in by_key.setdefault(loc, []):
            by_key[loc].append(message)
    parts = []
    for loc, messages in by_key.items():
        key = describe_location(loc)
        typed = _typed(key, overrides, made=loc in unknown) if loc else None
        origin = f"command line {typed}" if typed is not None else source
        why = " or ".join(messages)
        parts.append(f"{origin}: {why}" if not loc or loc in unknown else f"{origin}: `{key}`: {why}")
    return "; ".join(parts)


def _typed(key: str, overrides: Mapping[str, str], *, made: bool) -> str | None:
    """The override that set `key` (itself, or a section above it; for an unknown key `made`, also one
    below it, which made the key), else None."""
    for dotted, text in reversed(list(overrides.items())):  # the last override of a key is the one kept
        if key == dotted or key.startswith(dotted + ".") or (made and dotted.startswith(key + ".")):
            return text
    return None


def _field_path(model: type[BaseModel], loc: Sequence[Any]) -> tuple[Any, ...]:
    """`loc` without the member names pydantic puts after a union field (`constrained-int`,
    `literal['auto']`): only the keys a user writes."""
    out: list[Any] = []
    current: Any = model
    member_tag_next = False
    for part in loc:
        if member_tag_next:
            member_tag_next = False
            current = next((m for m in _models(current) if m.__name__ == part), None)
            continue
        fields = _fields(current)
        current = fields.get(part) if fields is not None else _member_value(current)
        out.append(part)
        member_tag_next = _is_union(current)
    return tuple(out)


def _is_union(annotation: Any) -> bool:
    """A type of two or more members besides None (pydantic names the member in an error's location)."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _is_union(typing.get_args(annotation)[0])
    members = [a for a in typing.get_args(annotation) if a is not type(None)]
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(members) >= 2


def _unknown_key(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """`section has no key name; did you mean …? (its keys: …)` for a key the section does not take."""
    current: Any = model
    for part in loc[:-1]:
        fields = _fields(current)
        current = fields.get(part) if fields is not None else _member_value(current)
    fields = _fields(current) or {}
    name = describe_location(loc[-1:])  # an odd key (a newline, a space) quoted
    where = f"{describe_location(loc[:-1])} has" if len(loc) > 1 else "the config has"
    close = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.6)
    if close:
        above = describe_location(loc[:-1])
        return (
            f"{where} no key {name}; did you mean {above + '.' if above != '(top level)' else ''}{close[0]}?"
        )
    return f"{where} no key {name} (its keys: {', '.join(fields)}; all are in docs/config.md)"


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The config sections a field's type holds (itself, or the members of a union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _fields(annotation: Any) -> dict[str, Any] | None:
    """Field name → type of the section a type holds (the first of a union), or None for a value."""
    found = _models(annotation)
    if not found:
        return None
    return {name: info.annotation for name, info in found[0].model_fields.items()}


def _member_value(annotation: Any) -> Any:
    """The value type of a mapping (`dict[str, X]`) or list field, else None."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (dict, list):
        return args[-1]
    return next((v for a in args if (v := _member_value(a)) is not None), None)

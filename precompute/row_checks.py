"""A dataset's rows checked as the docs define them, before anything is tokenised: each refusal is one
line naming the row and the column (`docs/config.md`, `docs/reliability.md`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mopd.base.errors import ConfigError


def check_number_columns(features: Any, path: str) -> None:
    """`input_ids` and `loss_mask` are lists of numbers in every row. A list that mixes numbers with
    text, booleans or lists somewhere in the file is decoded by `datasets` as JSON (`"1"` becomes 1), so
    it is refused here, by its column's type, before any row is read.

    Raises:
        ConfigError: naming the column.
    """
    import datasets

    for column in ("input_ids", "loss_mask"):
        feature = features.get(column)
        inner = getattr(feature, "feature", None)
        numeric = isinstance(inner, datasets.Value) and inner.dtype.startswith(("int", "uint", "float"))
        if feature is not None and not (isinstance(feature, datasets.List | datasets.LargeList) and numeric):
            raise ConfigError(
                f"data.path {path}: {column} is not a list of numbers in every row (it holds {feature}): "
                "a row writes an entry as text, true or false, null or a list; write every entry as a number"
            )


def _numbers(value: Any, row: int, column: str, expected: str) -> np.ndarray:
    """A flat list of numbers as float64; text, booleans, nulls and nested lists are refused, never
    converted ("1" is not 1).

    Raises:
        ConfigError: naming the row and the column.
    """
    try:
        found = np.asarray(value)
    except ValueError:  # a ragged nesting
        found = np.asarray(None)
    if found.ndim != 1 or (found.size and found.dtype.kind not in "iuf"):
        raise ConfigError(f"row {row}: {column} must be a flat list of {expected}, got {value!r:.80}")
    return found.astype(np.float64)


def given_ids(value: Any, row: int, vocab: int) -> np.ndarray:
    """A row's `input_ids` as given, refused unless they are whole numbers in [0, vocab): a float
    would be cut (70.5 → 70) and an id past the tokenizer is a token no teacher was ever trained on.

    Raises:
        ConfigError: naming the row and the first offending id.
    """
    given = _numbers(value if value is not None else [], row, "input_ids", "token ids")
    bad = np.flatnonzero((given != np.floor(given)) | (given < 0) | (given >= vocab))
    if bad.size:
        raise ConfigError(
            f"row {row}: input_ids[{bad[0]}] = {given[bad[0]]:g} is not a token id of the tokenizer "
            f"(whole numbers from 0 to {vocab - 1})"
        )
    return given.astype(np.int64)


def given_mask(value: Any, row: int, length: int) -> np.ndarray:
    """A row's `loss_mask` as given: 0 or 1 for each of its `length` tokens.

    Raises:
        ConfigError: naming the row.
    """
    mask = _numbers(value, row, "loss_mask", "0 and 1")
    if mask.shape != (length,):
        raise ConfigError(f"row {row}: loss_mask has {mask.size} entries for {length} input_ids")
    if not np.isin(mask, (0, 1)).all():
        raise ConfigError(f"row {row}: loss_mask holds {mask[~np.isin(mask, (0, 1))][0]:g}; it takes 0 and 1")
    return mask.astype(np.uint8)


# The columns each row of a format must hold as strings (a messages row: a list of turns).
_TURN = ("role", "content")
_TEXT_COLUMNS = {"text": ("text",), "prompt+completion": ("prompt", "completion")}


def check_row_format(batch: Mapping[str, list[Any]], input_format: str, indices: list[int]) -> None:
    """Every row holds its format's columns: a dataset is one format, and a row of another (or with a
    null) would otherwise reach the tokenizer as None.

    Raises:
        ConfigError: naming the row, the column and the format.
    """
    for column in _TEXT_COLUMNS.get(input_format, ()):
        for k, value in enumerate(batch[column]):
            if not isinstance(value, str):
                raise ConfigError(
                    f"row {indices[k]}: {column} is {value!r:.40}, not text; every row of a {input_format} "
                    "dataset needs it (one row format per dataset)"
                )
    if input_format == "messages":
        for k, value in enumerate(batch["messages"]):
            if not isinstance(value, list) or not value:
                raise ConfigError(
                    f"row {indices[k]}: messages is {value!r:.40}, not a list of turns; every row of a "
                    "messages dataset needs one (one row format per dataset)"
                )
            for turn in value:
                if not isinstance(turn, dict) or not all(isinstance(turn.get(key), str) for key in _TURN):
                    raise ConfigError(
                        f"row {indices[k]}: a turn of its messages is {turn!r:.60}, not a role and a content "
                        "of text"
                    )

"""Dataset ingest: files → tokenized rows with loss masks and teacher indices (DESIGN §3).

Accepted inputs: anything HF `datasets` loads from a file or folder (jsonl, json, parquet, arrow, a
saved dataset folder) with one of these column sets, checked in this order:

- `input_ids` (+ optional `loss_mask`): used as given;
- `messages`: the shared tokenizer's chat template; loss on assistant turns only;
- `prompt` + `completion`: loss on the completion only;
- `text`: loss everywhere.

Loss-mask convention: `loss_mask[t] = 1` trains the prediction made at position t, i.e. of token t + 1.
So a row's last position is never trained, and for `prompt` + `completion` the first trained position
is the prompt's last token. Rows longer than `data.max_length` are cut to it (`overlong: truncate`) or
left out (`overlong: drop`); both are counted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mopd.store.config import DataConfig, RoutingConfig
from mopd.store.errors import ConfigError

FORMATS = ("input_ids", "messages", "prompt+completion", "text")


@dataclass
class TokenizedRows:
    """The dataset after tokenisation and routing; row i of every list is row i of the store."""

    input_ids: list[np.ndarray]
    loss_mask: list[np.ndarray]
    agents: list[str]
    source_keys: list[str]
    teacher_index: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    num_truncated: int = 0
    num_dropped: int = 0
    input_format: str = ""

    @property
    def num_rows(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(ids) for ids in self.input_ids], dtype=np.int64)

    def fingerprint(self) -> str:
        """sha256 of every row's tokens, mask, teacher index and source key: the dataset's identity."""
        digest = hashlib.sha256()
        for ids, mask, teacher, key in zip(
            self.input_ids, self.loss_mask, self.teacher_index, self.source_keys, strict=True
        ):
            digest.update(np.int64(len(ids)).tobytes() + ids.astype("<i4").tobytes())
            digest.update(
                mask.astype(np.uint8).tobytes() + np.int64(teacher).tobytes() + key.encode() + b"\0"
            )
        return digest.hexdigest()


def load_records(path: str | Path) -> Any:
    """Loads a dataset file or folder with HF `datasets` (no network).

    Raises:
        ConfigError: the path is missing or not a format `datasets` reads.
    """
    import datasets

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"data.path {path} does not exist")
    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            return loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded
        suffix = path.suffix.lower()
        builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}.get(suffix)
        if builder is None:
            raise ConfigError(
                f"data.path {path}: unknown file type {suffix!r}; use .jsonl, .json, .parquet, "
                ".arrow or a folder written by Dataset.save_to_disk"
            )
        if builder == "arrow":
            return datasets.Dataset.from_file(str(path))
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except ConfigError:
        raise
    except ValueError as err:
        if "corresponds to no data" in str(err):  # datasets' way of saying the file has no rows
            raise ConfigError(f"data.path {path} holds no rows") from err
        raise ConfigError(f"data.path {path}: cannot be read as a dataset ({err})") from err
    except Exception as err:
        raise ConfigError(
            f"data.path {path}: cannot be read as a dataset ({type(err).__name__}: {err})"
        ) from err


def detect_format(columns: Sequence[str]) -> str:
    names = set(columns)
    if "input_ids" in names:
        return "input_ids"
    if "messages" in names:
        return "messages"
    if {"prompt", "completion"} <= names:
        return "prompt+completion"
    if "text" in names:
        return "text"
    raise ConfigError(
        f"dataset columns {sorted(names)} hold no supported input; provide `input_ids` (+ `loss_mask`), "
        "`messages`, `prompt` + `completion`, or `text`"
    )


def _next_token_mask(trained_tokens: np.ndarray) -> np.ndarray:
    """loss_mask[t] = trained_tokens[t + 1]: position t predicts token t + 1; the last never trains."""
    mask = np.zeros(trained_tokens.shape[0], dtype=np.uint8)
    mask[:-1] = trained_tokens[1:]
    return mask


def _tokenize_messages(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
    def render(upto: int, *, generation_prompt: bool) -> list[int]:
        if upto == 0:
            return []
        ids = tokenizer.apply_chat_template(
            messages[:upto], tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
        )
        return list(ids)

    ids = np.array(render(len(messages), generation_prompt=False), dtype=np.int64)
    trained = np.zeros(ids.shape[0], dtype=np.uint8)
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = len(render(k, generation_prompt=True))
        stop = len(render(k + 1, generation_prompt=False))
        if ids[:stop].tolist() != render(k + 1, generation_prompt=False):
            raise ConfigError(
                "the chat template does not render conversations prefix by prefix; "
                "mopd cannot locate assistant turns (use prompt + completion instead)"
            )
        trained[start:stop] = 1
    return ids, _next_token_mask(trained)


def _tokenize_row(
    record: Mapping[str, Any], input_format: str, tokenizer: Any
) -> tuple[np.ndarray, np.ndarray]:
    if input_format == "input_ids":
        ids = np.asarray(record["input_ids"], dtype=np.int64)
        if record.get("loss_mask") is not None:
            mask = np.asarray(record["loss_mask"], dtype=np.uint8)
            if mask.shape != ids.shape:
                raise ConfigError(f"loss_mask has {mask.shape[0]} entries for {ids.shape[0]} input_ids")
            return ids, mask
        return ids, _next_token_mask(np.ones_like(ids, dtype=np.uint8))
    if input_format == "messages":
        return _tokenize_messages(tokenizer, list(record["messages"]))
    if input_format == "prompt+completion":
        prompt = tokenizer(record["prompt"])["input_ids"]
        completion = tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
        ids = np.array([*prompt, *completion], dtype=np.int64)
        trained = np.r_[np.zeros(len(prompt), np.uint8), np.ones(len(completion), np.uint8)]
        return ids, _next_token_mask(trained)
    ids = np.array(tokenizer(record["text"])["input_ids"], dtype=np.int64)
    return ids, _next_token_mask(np.ones_like(ids, dtype=np.uint8))


def route(
    agents: Sequence[str],
    routing: RoutingConfig,
    agent_to_alias: Mapping[str, str],
    alias_index: Mapping[str, int],
) -> np.ndarray:
    """Teacher index per row: agent → alias → checkpoint index; unknown agents only with a default.

    Raises:
        ConfigError: naming the first unknown agent and its row.
    """
    out = np.empty(len(agents), dtype=np.int64)
    for row, agent in enumerate(agents):
        alias = agent_to_alias.get(agent, routing.default_teacher)
        if alias is None:
            raise ConfigError(
                f"row {row}: agent {agent!r} has no teacher (routing.teacher_by_agent knows "
                f"{sorted(agent_to_alias)}); add it there or set routing.default_teacher"
            )
        out[row] = alias_index[alias]
    return out


def tokenize_dataset(
    records: Any,
    *,
    data: DataConfig,
    routing: RoutingConfig,
    agent_to_alias: Mapping[str, str],
    alias_index: Mapping[str, int],
    tokenizer: Any,
    progress: Callable[[int], None] | None = None,
) -> TokenizedRows:
    """Tokenizes, applies the max_length policy and routes every row.

    Raises:
        ConfigError: empty dataset, unsupported columns, missing routing column, unknown agent.
    """
    columns = list(records.column_names)
    if len(records) == 0:
        raise ConfigError(f"data.path {data.path} holds no rows")
    input_format = detect_format(columns)
    if routing.field not in columns and routing.default_teacher is None:
        raise ConfigError(
            f"dataset has no routing column {routing.field!r} (columns: {sorted(columns)}); add it, set "
            "routing.field to the column that names each row's agent, or set routing.default_teacher"
        )
    out = TokenizedRows(input_ids=[], loss_mask=[], agents=[], source_keys=[], input_format=input_format)
    for i, record in enumerate(records):
        ids, mask = _tokenize_row(record, input_format, tokenizer)
        if ids.shape[0] == 0:
            raise ConfigError(f"row {i} tokenizes to no tokens")
        if ids.shape[0] > data.max_length:
            if data.overlong == "drop":
                out.num_dropped += 1
                continue
            ids, mask = ids[: data.max_length], mask[: data.max_length].copy()
            mask[-1] = 0  # its next token was cut off
            out.num_truncated += 1
        out.input_ids.append(ids)
        out.loss_mask.append(mask)
        out.agents.append(str(record[routing.field]) if routing.field in record else "")
        key = record.get("id")
        out.source_keys.append(
            str(key) if key is not None else hashlib.sha256(ids.tobytes()).hexdigest()[:16]
        )
        if progress is not None:
            progress(1)
    if out.num_rows == 0:
        raise ConfigError(
            f"every row of {data.path} is longer than data.max_length={data.max_length} "
            "and overlong: drop left none"
        )
    out.teacher_index = route(out.agents, routing, agent_to_alias, alias_index)
    return out

"""A rollout's rows: the sampled ids exactly, their text, the routing column and the provenance.

Each row holds `input_ids` (the prompt's ids, then the sampled ids) and `loss_mask` (the completion
trained), which `mopd precompute` reads ahead of any text column, so the teachers score exactly the
tokens the student wrote even where its ids are not the tokenizer's own encoding of their text. The
text columns (`prompt` + `completion`, or `messages` with the new assistant turn) say the same for
people and for tools that read text: for a completion in the tokenizer's own encoding, precompute's text
path gives the same ids and mask.

A chat completion that stopped is closed as the chat template closes an assistant turn (the turn-end
token and what the template writes after it), as precompute renders a `messages` row; one cut at
max_new_tokens is left open and marked `truncated`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mopd.base import faults
from mopd.base.errors import ConfigError
from mopd.base.fsio import write_replace_with
from mopd.precompute.data import next_token_mask
from mopd.rollout.prompts import Prompt, PromptFormat
from mopd.rollout.samplers import Completion

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
PROVENANCE = [
    ("finish_reason", pa.string()),
    ("truncated", pa.bool_()),
    ("prompt_truncated", pa.bool_()),
    ("round", pa.int32()),
    ("prompt_index", pa.int64()),
    ("sample_index", pa.int32()),
    ("student", pa.string()),
    ("student_fingerprint", pa.string()),
    ("sampling_backend", pa.string()),
    ("sampling_temperature", pa.float64()),
    ("sampling_top_p", pa.float64()),
    ("sampling_max_new_tokens", pa.int32()),
    ("sampling_seed", pa.int64()),
    ("sample_seed", pa.uint64()),
]


def row_schema(fmt: PromptFormat, route_field: str | None, teachers_field: str | None = None) -> pa.Schema:
    fields: list[tuple[str, pa.DataType]] = [("id", pa.string())]
    if route_field is not None:
        fields.append((route_field, pa.string()))
    if teachers_field is not None:
        fields.append((teachers_field, pa.list_(pa.string())))
    if fmt == "messages":
        fields.append(("messages", pa.list_(MESSAGE)))
    else:
        fields += [("prompt", pa.string()), ("completion", pa.string())]
    fields += [("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())), *PROVENANCE]
    return pa.schema(fields)


def sample_seed(seed: int, round_index: int, prompt_index: int) -> int:
    """The seed of one prompt's samples: a pure function of the rollout seed, round and prompt row."""
    digest = hashlib.sha256(f"mopd-rollout/{seed}/{round_index}/{prompt_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def sample_row(
    prompt: Prompt,
    completion: Completion,
    *,
    fmt: PromptFormat,
    tokenizer: Any,
    turn_end: Sequence[int],
    route_field: str | None,
    provenance: Mapping[str, Any],
    teachers_field: str | None = None,
) -> dict[str, Any]:
    """One row: the prompt's ids, the sampled ids (a stopped chat turn closed by the template), text."""
    sampled = completion.token_ids
    stopped = completion.finish == "stop"
    if fmt == "messages":
        content_ids = sampled[:-1] if stopped else sampled
        completion_ids = [*content_ids, *turn_end] if stopped else list(content_ids)
    else:
        content_ids = completion_ids = list(sampled)
    ids = np.array([*prompt.ids, *completion_ids], dtype=np.int64)
    trained = np.r_[np.zeros(len(prompt.ids), np.uint8), np.ones(len(completion_ids), np.uint8)]
    text = tokenizer.decode(content_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    row: dict[str, Any] = {"id": f"{prompt.key}/s{provenance['sample_index']}"}
    if route_field is not None:
        row[route_field] = prompt.route
    if teachers_field is not None:
        row[teachers_field] = prompt.teachers
    if fmt == "messages":
        turns = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt.messages or []]
        row["messages"] = [*turns, {"role": "assistant", "content": text}]
    else:
        row["prompt"], row["completion"] = prompt.text, text
    row["input_ids"] = ids.tolist()
    row["loss_mask"] = next_token_mask(trained).tolist()
    row["finish_reason"] = completion.finish
    row["truncated"] = not stopped
    row["prompt_truncated"] = prompt.truncated
    return {**row, **provenance}


def write_part(path: Path, rows: list[dict[str, Any]], schema: pa.Schema) -> None:
    """One part of a rollout, durably (temp, fsync, rename): a part that exists is whole."""
    write_replace_with(path, lambda temp: pq.write_table(pa.Table.from_pylist(rows, schema=schema), temp))
    faults.point("samples-renamed")


def read_part(path: Path) -> pa.Table:
    return pq.read_table(path)


def write_dataset(path: Path, tables: Iterable[pa.Table], schema: pa.Schema) -> int:
    """The rollout's dataset at `path` (.jsonl or .parquet), durably, one table at a time; its rows."""
    count = 0

    def parquet(temp: Path) -> None:
        nonlocal count
        with pq.ParquetWriter(temp, schema) as writer:
            for table in tables:
                writer.write_table(table)
                count += table.num_rows

    def jsonl(temp: Path) -> None:
        nonlocal count
        with temp.open("w", encoding="utf-8") as f:
            for table in tables:
                for row in table.to_pylist():
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
                count += table.num_rows

    write_replace_with(path, parquet if path.suffix == ".parquet" else jsonl)
    return count


def check_output_suffix(path: Path) -> None:
    if path.suffix not in (".jsonl", ".parquet"):
        raise ConfigError(
            f"rollout output {path}: the format comes from the extension; use .jsonl or .parquet"
        )

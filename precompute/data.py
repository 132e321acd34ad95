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

import functools
import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc

from mopd.base.errors import ConfigError
from mopd.config.precompute import DataConfig, RoutingConfig
from mopd.precompute.cross_rows import (
    CROSS_COLUMNS,
    CrossTokenizers,
    cross_columns,
    empty_columns,
    refuse_given_ids,
)
from mopd.precompute.routing import own_aliases, route, row_set
from mopd.precompute.row_checks import check_number_columns, check_row_format, given_ids, given_mask
from mopd.precompute.rows import TokenizedRows, rows_fingerprint
from mopd.store.format.layout import TEACHER_SET

FORMATS = ("input_ids", "messages", "prompt+completion", "text")
_ROWS_PER_PROCESS = 10_000  # fewer rows per process than this tokenise faster in one (process start-up)


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


def next_token_mask(trained_tokens: np.ndarray) -> np.ndarray:
    """loss_mask[t] = trained_tokens[t + 1]: position t predicts token t + 1; the last never trains."""
    mask = np.zeros(trained_tokens.shape[0], dtype=np.uint8)
    mask[:-1] = trained_tokens[1:]
    return mask


def render_chat(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], *, generation_prompt: bool
) -> list[int]:
    """The chat template's token ids of a conversation (with the assistant's generation prompt).

    Raises:
        ConfigError: the tokenizer has no chat template.
    """
    if not messages:
        return []
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '')} has no chat template, which `messages` "
            "rows need; set `tokenizer` to a checkpoint whose tokenizer has one, or give the rows as `text` "
            "(or `prompt` and `completion`)"
        )
    ids = tokenizer.apply_chat_template(
        list(messages), tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
    )
    return [int(t) for t in ids]


def _tokenize_messages(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
    def render(upto: int, *, generation_prompt: bool) -> list[int]:
        return render_chat(tokenizer, messages[:upto], generation_prompt=generation_prompt)

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
    return ids, next_token_mask(trained)


def _tokenize_chat(tokenizer: Any, messages: list[dict[str, str]], row: int) -> tuple[np.ndarray, np.ndarray]:
    try:
        return _tokenize_messages(tokenizer, messages)
    except ConfigError:
        raise
    except Exception as err:  # jinja2's TemplateError, or what a template's own code raises
        raise ConfigError(f"row {row}: the chat template cannot render its messages ({err})") from err


def tokenize_records(
    batch: Mapping[str, list[Any]], input_format: str, tokenizer: Any, indices: list[int]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(token ids, loss mask) of every record of a batch; text is tokenised in one batched call.
    `indices` are the records' rows in the source, which errors name."""
    size = len(next(iter(batch.values())))
    check_row_format(batch, input_format, indices)
    if input_format == "text":
        encoded = tokenizer(batch["text"])["input_ids"]
        rows = [np.asarray(e, dtype=np.int64) for e in encoded]
        return [(ids, next_token_mask(np.ones_like(ids, dtype=np.uint8))) for ids in rows]
    if input_format == "prompt+completion":
        prompts = tokenizer(batch["prompt"])["input_ids"]
        completions = tokenizer(batch["completion"], add_special_tokens=False)["input_ids"]
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            trained = np.r_[np.zeros(len(prompt), np.uint8), np.ones(len(completion), np.uint8)]
            out.append((np.array([*prompt, *completion], dtype=np.int64), next_token_mask(trained)))
        return out
    if input_format == "messages":
        return [
            _tokenize_chat(tokenizer, list(m), row) for m, row in zip(batch["messages"], indices, strict=True)
        ]
    out = []
    vocab = len(tokenizer)
    for k in range(size):
        ids = given_ids(batch["input_ids"][k], indices[k], vocab)
        given = batch["loss_mask"][k] if "loss_mask" in batch else None
        if given is None:
            out.append((ids, next_token_mask(np.ones_like(ids, dtype=np.uint8))))
            continue
        out.append((ids, given_mask(given, indices[k], ids.shape[0])))
    return out


ROW_FEATURES = {
    "input_ids": ("list", "int32"),
    "loss_mask": ("list", "uint8"),
    "agent": ("value", "string"),
    "source_key": ("value", "string"),
    "teacher_index": ("value", "int16"),
    TEACHER_SET: ("value", "int64"),
    "truncated": ("value", "bool"),
}


def _row_features(cross: bool) -> Any:
    import datasets

    features = {
        name: datasets.List(datasets.Value(dtype)) if kind == "list" else datasets.Value(dtype)
        for name, (kind, dtype) in ROW_FEATURES.items()
    }
    if cross:  # the columns exist only in rows of a store with teachers of other tokenizers
        features |= {name: datasets.List(datasets.Value(dtype)) for name, dtype in CROSS_COLUMNS.items()}
    return datasets.Features(features)


def _tokenize_batch(
    batch: dict[str, list[Any]],
    indices: list[int],
    *,
    input_format: str,
    tokenizer: Any,
    data: DataConfig,
    routing: RoutingConfig,
    agent_to_alias: Mapping[str, str | list[str]],
    alias_index: Mapping[str, int],
    contexts: Mapping[int, int],
    cross: CrossTokenizers | None = None,
) -> dict[str, list[Any]]:
    """One `datasets.map` batch: tokenise, route, apply the length policy (a dropped row is left out of
    the output). A row's limit is data.max_length, and its teacher's context where that is shorter:
    the states a teacher computes past its context are not its distribution. `indices` are the rows'
    positions in the source, which errors name. A row routed to a teacher of another tokenizer (`cross`)
    is tokenised by that teacher too, and the two tokenisations aligned (`cross_rows`)."""
    names = [*ROW_FEATURES, *(CROSS_COLUMNS if cross is not None else ())]
    out: dict[str, list[Any]] = {name: [] for name in names}
    agents = [str(batch[routing.field][k]) if routing.field in batch else "" for k in range(len(indices))]
    own = own_teachers(batch, routing, indices)
    sets = route(agents, routing, agent_to_alias, alias_index, row_ids=indices, own=own)
    teachers = [row[0] for row in sets]
    # Each row's teacher of another tokenizer, if any: at most one, whose tokenisation the row carries.
    others = [_other_tokenizer(r, cross, row=i) for i, r in zip(indices, sets, strict=True)]
    for k, (i, (ids, mask)) in enumerate(
        zip(indices, tokenize_records(batch, input_format, tokenizer, indices), strict=True)
    ):
        if ids.shape[0] == 0:
            raise ConfigError(f"row {i} tokenizes to no tokens")
        limit = min([data.max_length, *(contexts.get(t, data.max_length) for t in sets[k])])
        teacher = _teacher_row(batch, k, i, others[k], input_format, cross)
        truncated = ids.shape[0] > limit
        if data.overlong == "drop" and (truncated or (teacher is not None and teacher[0].shape[0] > limit)):
            continue
        if truncated:
            ids, mask = ids[:limit], mask[:limit].copy()
            mask[-1] = 0  # its next token was cut off
        if cross is not None:
            columns = empty_columns()
            if teacher is not None and others[k] is not None:
                table = cross.teachers[others[k]][1]
                columns = cross_columns((ids, mask), teacher, table=table, cross=cross, limit=limit)
            for name, values in columns.items():
                out[name].append(values)
        key = batch["id"][k] if "id" in batch else None
        out["input_ids"].append(ids.astype(np.int32))
        out["loss_mask"].append(mask.astype(np.uint8))
        out["agent"].append(agents[k])
        key = str(key) if key is not None else hashlib.sha256(ids.tobytes()).hexdigest()[:16]
        out["source_key"].append(key)
        out["truncated"].append(truncated)
        out["teacher_index"].append(int(teachers[k]))
        out[TEACHER_SET].append(row_set(sets[k]))
    return out


def own_teachers(
    batch: dict[str, list[Any]], routing: RoutingConfig, indices: list[int]
) -> list[list[str] | None] | None:
    """Each row's own list of aliases in the `routing.teachers_field` column (None where it has none)."""
    if routing.teachers_field is None or routing.teachers_field not in batch:
        return None
    field = routing.teachers_field
    return [own_aliases(value, row=indices[k], field=field) for k, value in enumerate(batch[field])]


def _other_tokenizer(teachers: tuple[int, ...], cross: CrossTokenizers | None, *, row: int) -> int | None:
    """The row's teacher of another tokenizer than the store's (None: it has none).

    Raises:
        ConfigError: the row has two such teachers.
    """
    others = [t for t in teachers if cross is not None and t in cross.teachers]
    if len(others) > 1:
        raise ConfigError(
            f"row {row} has {len(others)} teachers of tokenizers other than the store's (teachers "
            f"{', '.join(map(str, others))}); a row may have one such teacher, beside any number of the "
            "store's tokenizer: give the others other rows"
        )
    return others[0] if others else None


def _teacher_row(
    batch: Mapping[str, list[Any]],
    k: int,
    row: int,
    teacher: int | None,
    input_format: str,
    cross: CrossTokenizers | None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Record k tokenised by its teacher of another tokenizer (`teacher`, None: it has none)."""
    if cross is None or teacher is None:
        return None
    if input_format == "input_ids":  # rollout's rows carry their text beside the sampled ids
        given = [name for name in batch if name not in ("input_ids", "loss_mask")]
        if not {"messages", "text"} & set(given) and not {"prompt", "completion"} <= set(given):
            refuse_given_ids(row, teacher)
        input_format = detect_format(given)
    record = {name: [values[k]] for name, values in batch.items() if name not in ("input_ids", "loss_mask")}
    return tokenize_records(record, input_format, cross.teachers[teacher][0], [row])[0]


def _map_rows(
    records: Any,
    tokenize: Any,
    processes: int | None,
    show_progress: bool,
    cache_file: Path | None,
    cross: bool,
) -> Any:
    """`tokenize` over every row, in batches (`datasets.map`), into Arrow; the source's row order."""
    import datasets

    if show_progress:
        datasets.enable_progress_bars()
    environ = os.environ  # a map over several processes leaves another mapping bound to os.environ;
    try:  # put the original back, which rich and every module that captured it still read
        return records.map(
            tokenize,
            batched=True,
            batch_size=1000,
            with_indices=True,
            remove_columns=list(records.column_names),
            features=_row_features(cross),
            num_proc=processes,
            cache_file_name=str(cache_file) if cache_file is not None else None,
            load_from_cache_file=False,
            desc="tokenising rows",
        )
    finally:
        datasets.disable_progress_bars()
        os.environ = environ  # noqa: B003 - restoring the same object, not clearing it


def tokenize_dataset(
    records: Any,
    *,
    data: DataConfig,
    routing: RoutingConfig,
    agent_to_alias: Mapping[str, str | list[str]],
    alias_index: Mapping[str, int],
    tokenizer: Any,
    contexts: Mapping[int, int] | None = None,
    num_proc: int | None = None,
    show_progress: bool = False,
    cache_file: Path | None = None,
    cross: CrossTokenizers | None = None,
) -> TokenizedRows:
    """Tokenizes, applies the max_length policy and routes every row (a batched `datasets.map`).

    Args:
        contexts: teacher index → its context (max_position_embeddings): rows routed to it are held to
            it as to data.max_length (cut or dropped by data.overlong).
        num_proc: tokenising processes (None or 1: this one). The output's row order is the source's.
        cache_file: where `map` writes its Arrow output (None: memory, or datasets' own cache).
        cross: the tokenizers of the teachers of other tokenizers (None: there are none).

    Raises:
        ConfigError: empty dataset, unsupported columns, missing routing column, unknown agent.
    """
    columns = list(records.column_names)
    if len(records) == 0:
        raise ConfigError(f"data.path {data.path} holds no rows")
    input_format = detect_format(columns)
    if input_format == "input_ids":
        check_number_columns(records.features, data.path)
    if routing.field not in columns and routing.default_teacher is None:
        raise ConfigError(
            f"dataset has no routing column {routing.field!r} (columns: {sorted(columns)}); add it, set "
            "routing.field to the column that names each row's agent, or set routing.default_teacher"
        )
    tokenize = functools.partial(
        _tokenize_batch,
        input_format=input_format,
        tokenizer=tokenizer,
        data=data,
        routing=routing,
        agent_to_alias=dict(agent_to_alias),
        alias_index=dict(alias_index),
        contexts=dict(contexts or {}),
        cross=cross,
    )
    worth_it = num_proc is not None and num_proc > 1 and len(records) >= _ROWS_PER_PROCESS * num_proc
    processes = num_proc if worth_it else None
    mapped = _map_rows(records, tokenize, processes, show_progress, cache_file, cross is not None)
    if len(mapped) == 0:
        raise ConfigError(
            f"every row of {data.path} is longer than data.max_length={data.max_length} (or its "
            "teacher's context) and overlong: drop left none"
        )
    table = mapped.data.table
    meta = {
        "input_format": input_format,
        "num_truncated": int(pc.sum(table.column("truncated")).as_py() or 0),
        "num_dropped": len(records) - len(mapped),
        "fingerprint": rows_fingerprint(table),
    }
    return TokenizedRows(table, meta)

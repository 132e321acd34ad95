"""The prompts a rollout continues, tokenised exactly as `mopd precompute` tokenises the start of a row.

A `prompt` row is `tokenizer(prompt)` (special tokens added), as precompute tokenises the prompt of a
`prompt` + `completion` row. A `messages` row whose last turn is the user's is the chat template with
the generation prompt, as precompute renders the conversation up to an assistant turn. So the ids the
student continues are the ids precompute will put before its completion.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

from mopd.base.errors import ConfigError
from mopd.config.mopd_config import MopdConfig
from mopd.config.rollout import RolloutConfig
from mopd.precompute.data import render_chat
from mopd.precompute.records import load_records
from mopd.precompute.routing import check_aliases, own_aliases

PromptFormat = Literal["prompt", "messages"]


@dataclass(frozen=True)
class Prompt:
    index: int  # the row of the prompts dataset
    key: str  # its `id`, else `p<index>`
    ids: list[int]
    route: str | None  # its routing column's value, when the dataset has one
    teachers: list[str] | None  # its own teachers (`routing.teachers_field`), when it has a list
    text: str | None  # prompt format
    messages: list[dict[str, str]] | None  # messages format
    truncated: bool


def chat_turn_end(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The ids the chat template writes after an assistant turn's content (e.g. `<|im_end|>`, `\\n`).

    Raises:
        ConfigError: the template does not render the conversation prefix by prefix.
    """
    opened = render_chat(tokenizer, messages, generation_prompt=True)
    empty_turn = [*messages, {"role": "assistant", "content": ""}]
    closed = render_chat(tokenizer, empty_turn, generation_prompt=False)
    if closed[: len(opened)] != opened or len(closed) == len(opened):
        raise ConfigError(
            "the chat template does not render a conversation prefix by prefix, so mopd cannot tell where "
            "the student's turn starts and ends; use `prompt` rows instead"
        )
    return closed[len(opened) :]


@dataclass(frozen=True)
class PromptSet:
    prompts: list[Prompt]
    format: PromptFormat
    route_field: str | None  # the routing column carried over, None when the dataset has none
    teachers_field: str | None  # `routing.teachers_field` carried over, None when the dataset has none
    num_dropped: int
    fingerprint: str  # sha256 of every prompt's ids and key: what a resumed rollout must continue
    turn_end: list[int]  # messages format: the ids that close an assistant turn (chat_turn_end)

    @property
    def num_truncated(self) -> int:
        return sum(p.truncated for p in self.prompts)


def prompt_format(columns: list[str], *, path: str) -> PromptFormat:
    if "prompt" in columns:
        return "prompt"
    if "messages" in columns:
        return "messages"
    raise ConfigError(
        f"rollout.prompts {path}: columns {sorted(columns)} hold no prompt; give each row a `prompt` "
        "(text) or `messages` whose last turn is the user's"
    )


def _chat_prompt(messages: Any, row: int) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"rollout.prompts row {row}: `messages` is empty; it needs at least one user turn")
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "user":
        role = last.get("role") if isinstance(last, dict) else None
        raise ConfigError(
            f"rollout.prompts row {row}: the last turn is {role!r}, not the user's; the student writes the "
            "assistant turn that answers it"
        )
    return [dict(m) for m in messages]


def _tokenize(tokenizer: Any, record: dict[str, Any], fmt: PromptFormat, row: int) -> list[int]:
    if fmt == "messages":
        return render_chat(tokenizer, _chat_prompt(record.get("messages"), row), generation_prompt=True)
    text = record.get("prompt")
    if not isinstance(text, str) or not text:
        raise ConfigError(f"rollout.prompts row {row}: no prompt (the `prompt` field is empty or missing)")
    return [int(t) for t in tokenizer(text)["input_ids"]]


def read_prompts(config: MopdConfig, rollout: RolloutConfig, tokenizer: Any, *, path: str) -> PromptSet:
    """Reads and tokenises the prompts of `path`; applies `data.overlong` to prompts that leave fewer
    than `max_new_tokens` (and a chat turn's closing tail) of `data.max_length` (truncate: keep the
    prompt's first tokens; drop: leave it out).

    Raises:
        ConfigError: no prompt column, an empty prompt, a chat that does not end with the user, no
            routing column (and no default teacher), or no room for any completion.
    """
    records = load_records(path, key="rollout.prompts")
    columns = list(records.column_names)
    fmt = prompt_format(columns, path=path)
    probe = [{"role": "user", "content": "?"}]
    turn_end = chat_turn_end(tokenizer, probe) if fmt == "messages" else []
    # A stopped chat turn ends with the template's tail after the stop id: room for it too.
    room = config.data.max_length - rollout.max_new_tokens - max(0, len(turn_end) - 1)
    if room < 1:
        raise ConfigError(
            f"rollout.max_new_tokens {rollout.max_new_tokens} leaves no room for a prompt in data.max_length "
            f"{config.data.max_length}; lower it or raise data.max_length"
        )
    field = config.routing.field if config.routing.field in columns else None
    own_field = config.routing.teachers_field if config.routing.teachers_field in columns else None
    if field is None and own_field is None and config.routing.default_teacher is None:
        raise ConfigError(
            f"rollout.prompts {path} has no routing column {config.routing.field!r} (columns: "
            f"{sorted(columns)}); add it, or set routing.default_teacher"
        )
    prompts, dropped = [], 0
    digest = hashlib.sha256()
    for row, record in enumerate(records):
        teachers = _own_teachers(record, own_field, config, path=path, row=row)
        route = _route(record, field, config, path=path, row=row, own=teachers is not None)
        ids = _tokenize(tokenizer, record, fmt, row)
        cut = len(ids) > room
        if cut and config.data.overlong == "drop":
            dropped += 1
            continue
        if cut and fmt == "messages":
            raise ConfigError(
                f"rollout.prompts row {row}: its chat prompt has {len(ids)} tokens, more than "
                f"data.max_length − rollout.max_new_tokens = {room}; a chat cannot be cut without losing its "
                "generation prompt: shorten it, raise data.max_length, or set data.overlong: drop"
            )
        ids = ids[:room]
        key = str(record["id"]) if record.get("id") is not None else f"p{row}"
        digest.update(f"{key}\0{ids}\0".encode())
        if teachers is not None:  # what precompute will route it to: a resume must not mix two lists
            digest.update(f"teachers\0{teachers}\0".encode())
        prompts.append(
            Prompt(
                index=row,
                key=key,
                ids=ids,
                route=route,
                teachers=teachers,
                text=tokenizer.decode(ids, skip_special_tokens=False) if cut else record.get("prompt"),
                messages=record.get("messages") if fmt == "messages" else None,
                truncated=cut,
            )
        )
    if not prompts:
        raise ConfigError(f"rollout.prompts {path}: no prompt is left (all {dropped} are over the limit)")
    return PromptSet(prompts, fmt, field, own_field, dropped, digest.hexdigest(), turn_end)


def _own_teachers(
    record: dict[str, Any], field: str | None, config: MopdConfig, *, path: str, row: int
) -> list[str] | None:
    """The row's own list of teachers (`routing.teachers_field`), checked as precompute will check it;
    None where it has none (it is routed by its agent).

    Raises:
        ConfigError: naming the row, a value that is not a list of the config's teacher aliases.
    """
    if field is None:
        return None
    where = f"{row} of rollout.prompts {path}"
    aliases = own_aliases(record.get(field), row=where, field=field)
    if aliases is not None:
        check_aliases(aliases, config.teachers, row=where, field=field)
    return aliases


def _route(
    record: dict[str, Any], field: str | None, config: MopdConfig, *, path: str, row: int, own: bool
) -> str | None:
    """The row's routing value, checked as precompute will route it: a sample whose agent has no
    teacher would be written, then refused by precompute far from its cause. A row with its own
    teachers (`own`) needs no agent.

    Raises:
        ConfigError: naming the row, when the value is missing or names no teacher and there is no
            `routing.default_teacher`.
    """
    value = record.get(field) if field is not None else None
    if config.routing.default_teacher is not None or own:
        return None if value is None else str(value)
    if value is None:
        raise ConfigError(
            f"rollout.prompts {path} row {row}: no value in the routing column {field!r}; add it, or set "
            "routing.default_teacher"
        )
    known = config.agent_to_alias()
    if str(value) not in known:
        raise ConfigError(
            f"rollout.prompts {path} row {row}: agent {str(value)!r} has no teacher "
            f"(routing.teacher_by_agent knows {sorted(known)}); add it there or set routing.default_teacher"
        )
    return str(value)

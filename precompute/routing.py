"""Where a row's teachers are chosen: its own list of aliases (`routing.teachers_field`), else its
routing column's agent → alias (or list of aliases) → each alias's checkpoint index.

The table is the config's (`MopdConfig.agent_to_alias`: `routing.teacher_by_agent`, else each alias routes
its own name); the indices are the teachers' (`store.teachers.assign_teacher_indices`). Precompute routes
every row once, at ingest, and stores its teachers in the store: the lowest index as the row's teacher
index, and the whole set (`store.format.layout.set_mask`), each checkpoint once whatever its aliases.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from mopd.base.errors import ConfigError
from mopd.config.precompute import RoutingConfig, alias_list
from mopd.store.format.layout import MAX_SET_TEACHER, set_mask


def route(
    agents: Sequence[str],
    routing: RoutingConfig,
    agent_to_alias: Mapping[str, str | list[str]],
    alias_index: Mapping[str, int],
    *,
    row_ids: Sequence[int] | None = None,
    own: Sequence[list[str] | None] | None = None,
) -> list[tuple[int, ...]]:
    """Each row's teacher indices, ascending and each once: its own aliases (`own[k]`, where given), else
    agent → aliases → checkpoint indices; unknown agents only with a default.

    Raises:
        ConfigError: naming the first row (`row_ids[k]` for the k-th agent) with an unknown agent or
            alias or an empty list, or a row of several teachers in a store of more than
            `MAX_SET_TEACHER` + 1 teachers.
    """
    out = []
    for k, agent in enumerate(agents):
        row = row_ids[k] if row_ids is not None else k
        aliases = own[k] if own is not None else None
        if aliases is None:
            found = agent_to_alias.get(agent, routing.default_teacher)
            if found is None:
                raise ConfigError(
                    f"row {row}: agent {agent!r} has no teacher (routing.teacher_by_agent knows "
                    f"{sorted(agent_to_alias)}); add it there or set routing.default_teacher"
                )
            aliases = alias_list(found)
        out.append(_teachers(row, aliases, routing, alias_index))
    return out


def own_aliases(value: Any, *, row: int | str, field: str | None) -> list[str] | None:
    """A row's own list of aliases as its `routing.teachers_field` column holds it (None: the row is
    routed by its agent).

    Raises:
        ConfigError: naming the row, a value that is not a list of aliases.
    """
    if value is not None and not (isinstance(value, list) and all(isinstance(a, str) for a in value)):
        raise ConfigError(
            f"row {row}: {field} is {value!r}; it holds a list of teacher aliases (or null to route the "
            "row by its agent)"
        )
    return value


def check_aliases(aliases: list[str], known: Collection[str], *, row: int | str, field: str | None) -> None:
    """
    Raises:
        ConfigError: naming the row, an empty list or one with an alias that is not a teacher's.
    """
    unknown = [a for a in aliases if a not in known]
    if unknown or not aliases:
        what = f"names alias {unknown[0]!r}, not one of {sorted(known)}" if unknown else "is empty"
        raise ConfigError(f"row {row}: its {field} list {what}; correct the dataset")


def _teachers(
    row: int, aliases: list[str], routing: RoutingConfig, alias_index: Mapping[str, int]
) -> tuple[int, ...]:
    check_aliases(aliases, alias_index, row=row, field=routing.teachers_field)
    teachers = tuple(sorted({alias_index[a] for a in aliases}))
    if len(teachers) > 1 and max(alias_index.values()) > MAX_SET_TEACHER:
        raise ConfigError(
            f"row {row} has several teachers ({', '.join(aliases)}), which a store of at most "
            f"{MAX_SET_TEACHER + 1} teachers allows; this config has {max(alias_index.values()) + 1}"
        )
    return teachers


def row_set(teachers: tuple[int, ...]) -> int:
    """The `teacher_set` value of a row: its bits, or 0 for a row of one teacher past MAX_SET_TEACHER (a
    store of so many teachers has no row of several)."""
    return set_mask(teachers) if teachers[-1] <= MAX_SET_TEACHER else 0

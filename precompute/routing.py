"""Where a row's teacher is chosen: its routing column's agent → alias → the alias's checkpoint index.

The table is the config's (`MopdConfig.agent_to_alias`: `routing.teacher_by_agent`, else each alias routes
its own name); the indices are the teachers' (`store.teachers.assign_teacher_indices`). Precompute routes
every row once, at ingest, and stores its teacher index in the store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from mopd.base.errors import ConfigError
from mopd.config.precompute import RoutingConfig


def route(
    agents: Sequence[str],
    routing: RoutingConfig,
    agent_to_alias: Mapping[str, str],
    alias_index: Mapping[str, int],
    *,
    row_ids: Sequence[int] | None = None,
) -> np.ndarray:
    """Teacher index per row: agent → alias → checkpoint index; unknown agents only with a default.

    Raises:
        ConfigError: naming the first unknown agent and its row (`row_ids[k]` for the k-th agent).
    """
    out = np.empty(len(agents), dtype=np.int64)
    for k, agent in enumerate(agents):
        alias = agent_to_alias.get(agent, routing.default_teacher)
        if alias is None:
            raise ConfigError(
                f"row {row_ids[k] if row_ids is not None else k}: agent {agent!r} has no teacher "
                f"(routing.teacher_by_agent knows {sorted(agent_to_alias)}); add it there or set "
                "routing.default_teacher"
            )
        out[k] = alias_index[alias]
    return out

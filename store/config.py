"""The store's section of the YAML config, and the strict base every section of that file shares.

The file as a whole, and the sections that the store never reads, are `mopd.config`'s.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are errors, values are frozen, NaN and infinity are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class StoreConfig(Section):
    path: str = "out/teachers.zarr"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    codec: Literal["shuffle-zstd1", "none"] = "shuffle-zstd1"

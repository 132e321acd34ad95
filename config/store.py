"""The `store` section of the YAML config: where precompute writes and in what form."""

from __future__ import annotations

from typing import Literal

from mopd.base.section import NonEmpty, Section


class StoreConfig(Section):
    path: NonEmpty = "out/teachers.zarr"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    codec: Literal["shuffle-zstd1", "none"] = "shuffle-zstd1"

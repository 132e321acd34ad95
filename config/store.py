"""The `store` section of the YAML config: where precompute writes and in what form."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from mopd.base.errors import ConfigError
from mopd.base.fsio import store_folder
from mopd.base.section import NonEmpty, Section


class StoreConfig(Section):
    # A folder on a local or shared filesystem: a path or a file:// URL.
    path: NonEmpty = "out/teachers.zarr"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    codec: Literal["shuffle-zstd1", "none"] = "shuffle-zstd1"

    @field_validator("path")
    @classmethod
    def _a_folder(cls, path: str) -> str:
        try:
            return str(store_folder(path, what="store.path"))
        except ConfigError as err:
            raise ValueError(str(err).removeprefix("store.path ")) from None

"""The `store` section of the YAML config: where precompute writes and in what form."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from mopd.base.errors import ConfigError
from mopd.base.fsio import store_location
from mopd.base.section import NonEmpty, Section

# Names of object-storage settings that hold a secret: they come from the environment, since mopd records
# the config in the store and in every checkpoint.
_SECRET = re.compile(r"secret|token|password|credential|access_key|key_id|sas|private", re.IGNORECASE)


class StoreConfig(Section):
    # A folder on a local or shared filesystem (a path or a file:// URL), or a prefix in object storage
    # (s3://bucket/prefix, gs://bucket/prefix).
    path: NonEmpty = "out/teachers.zarr"
    # Settings of the object-storage client (obstore's: endpoint, region, allow_http...), beside the
    # environment's; never credentials, which the environment holds (the config is recorded).
    options: dict[str, str] = Field(default_factory=dict)
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    codec: Literal["shuffle-zstd1", "none"] = "shuffle-zstd1"
    # `exact`: hidden states in `dtype`. `int8-rotated`: 8-bit codes of the rotated states, about 2/3 of
    # a bf16 store's bytes for a measured KL of ~3e-4 nats a token (docs/store-format.md).
    encoding: Literal["exact", "int8-rotated"] = "exact"

    @field_validator("path")
    @classmethod
    def _a_folder(cls, path: str) -> str:
        try:
            return store_location(path, what="store.path")
        except ConfigError as err:
            raise ValueError(str(err).removeprefix("store.path ")) from None

    @field_validator("options")
    @classmethod
    def _no_secrets(cls, options: dict[str, str]) -> dict[str, str]:
        secrets = sorted(name for name in options if _SECRET.search(name))
        if secrets:
            raise ValueError(
                f"{secrets[0]}: credentials do not belong in the config, which mopd records in the store and "
                "in every checkpoint; set them in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                "GOOGLE_APPLICATION_CREDENTIALS...)"
            )
        return options

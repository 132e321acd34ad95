"""The strict base every section of the YAML config shares, and the value types its fields use."""

from __future__ import annotations

import re
import types
import typing
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# A path or checkpoint name: an empty one would silently mean the config's own folder.
NonEmpty = Annotated[str, Field(min_length=1)]

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _device_name(value: str) -> str:
    if not _DEVICE.fullmatch(value):
        raise ValueError(f"{value!r} is not a device: use auto, cpu, cuda or cuda:N")
    return value


# A compute device as a config names it; whether cuda:N exists is checked where it is used
# (`base.devices.resolve_device`), since a config may be read on a machine without that GPU.
Device = Annotated[str, AfterValidator(_device_name)]


def _takes(annotation: Any, kinds: tuple[type, ...]) -> bool:
    """Whether a field of this type holds a value of one of `kinds` (alone or in a union)."""
    if annotation in kinds:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_takes(arg, kinds) for arg in typing.get_args(annotation))
    return False


def _takes_bool(annotation: Any) -> bool:
    return _takes(annotation, (bool,))


def _value_type(annotation: Any) -> Any:
    """The value type of a `dict[str, X]` field (None for any other type)."""
    if typing.get_origin(annotation) is dict:
        return typing.get_args(annotation)[1]
    return None


class Section(BaseModel):
    """A config section: unknown keys are errors, values are frozen, NaN and infinity are refused, and
    YAML booleans are never taken for numbers or strings for booleans or numbers (`max_length: true` is
    not 1, `trust_remote_code: "yes"` is not true, `seed: "1"` is not 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_coercion(cls, value: Any, info: ValidationInfo) -> Any:
        annotation = cls.model_fields[info.field_name or ""].annotation
        _check_bool(value, _takes_bool(annotation))
        if isinstance(value, str) and _takes(annotation, (int, float)) and not _takes(annotation, (str,)):
            fix = "write it without quotes" if _numeric(value) else "write a number, e.g. 5000 or 3e-4"
            raise ValueError(f"{value!r} is text, not a number ({fix})")
        inner = _value_type(annotation)
        if inner is not None and isinstance(value, dict):
            for key, item in value.items():
                _check_bool(item, _takes_bool(inner), str(key))
        return value


def _numeric(text: str) -> bool:
    """Whether YAML would have read `text` as a number had it not been quoted."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_bool(value: Any, wants_bool: bool, key: str = "") -> None:
    where = f"{key}: " if key else ""
    if wants_bool and value is not None and not isinstance(value, bool):
        raise ValueError(f"{where}expected true or false, got {value!r}")
    if not wants_bool and isinstance(value, bool):
        raise ValueError(f"{where}{str(value).lower()} is a boolean, not a value this key takes")

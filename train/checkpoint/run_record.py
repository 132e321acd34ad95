"""What a training run was trained on: the store's identity and every setting that fixes the data order
or the objective; a resume with any of it changed is refused (which may change: docs/internals.md).
"""

from __future__ import annotations

from typing import Any, TypeAlias

from pydantic import BaseModel, JsonValue, TypeAdapter

from mopd.config.train import TrainConfig
from mopd.store.format.manifest import Manifest

RESUMABLE = frozenset(
    {
        "train.steps",
        "train.checkpoint.every",
        "train.checkpoint.keep",
        "train.output_dir",
        "train.eval.every",
        "train.device",
        "train.lm_head_lifecycle",
        "train.divergence.chunk_size",
        "train.divergence.compile",
        "train.parallel.tp",
        "train.parallel.pp",
        "train.parallel.sequence_parallel",
        "train.parallel.dp_replicate",
        "train.parallel.gradient_sync",
        "train.activation_checkpointing",
        "train.student",
        "train.init_from",
        "train.prefetch",
        "train.report_to",
    }
)


def _flatten(prefix: str, section: BaseModel, out: dict[str, Any]) -> None:
    """Config sections become dotted names; every other value (a mapping too) is one field."""
    for name in type(section).model_fields:
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            _flatten(f"{prefix}.{name}", value, out)
        else:
            out[f"{prefix}.{name}"] = TypeAdapter(Any).dump_python(value, mode="json")


# Dotted setting names (and the store's identity) → their JSON values: flat, so that a difference names
# its field.
RunRecord: TypeAlias = dict[str, JsonValue]


# Recorded by what they decide, not as written: a projection file by its entries' fingerprint, under this
# name, as the store's own projections are (and only in a run with teachers of other tokenizers).
PROJECTIONS = "train.cross_tokenizer.projection"


def run_record(tc: TrainConfig, manifest: Manifest, projections: dict[int, str] | None = None) -> RunRecord:
    """The fields a resume must find unchanged, as dotted names → JSON values. `projections`: each
    teacher of another tokenizer's projection fingerprint."""
    fields: dict[str, Any] = {}
    _flatten("train", tc, fields)
    skipped = (*RESUMABLE, PROJECTIONS)
    fields = {k: v for k, v in fields.items() if not any(k == r or k.startswith(r + ".") for r in skipped)}
    if projections:
        fields[PROJECTIONS] = {str(t): fingerprint for t, fingerprint in sorted(projections.items())}
    fields["store.manifest_hash"] = manifest.hash()
    fields["store.dataset_fingerprint"] = manifest.dataset.fingerprint
    fields["store.encoding"] = manifest.storage.encoding
    fields.update(tokenizer_fields(manifest))
    return dict(sorted(fields.items()))


def tokenizer_fields(manifest: Manifest) -> dict[str, str]:
    """The tokenizers a store with teachers of other tokenizers was aligned with, by fingerprint: the
    student's (`store.tokenizer`) and each such teacher's (`store.teacher_tokenizer.{index}`); none for
    a store of one tokenizer, whose run records stay as they were."""
    if not manifest.tokenizer.fingerprint:
        return {}
    fields = {"store.tokenizer": manifest.tokenizer.fingerprint}
    for teacher in manifest.teachers:
        if teacher.tokenizer is not None:
            fields[f"store.teacher_tokenizer.{teacher.index}"] = teacher.tokenizer.fingerprint
    return fields


def is_tokenizer_field(name: str) -> bool:
    return name == "store.tokenizer" or name.startswith("store.teacher_tokenizer.")


def diff_run_records(recorded: RunRecord, current: RunRecord) -> list[str]:
    """One line per field whose value differs: `name: A in the checkpoint, B now`."""
    lines = []
    for name in sorted(set(recorded) | set(current)):
        old = recorded.get(name, "(not recorded)")
        new = current.get(name, "(not set)")
        if old != new:
            lines.append(f"{name}: {_show(old)} in the checkpoint, {_show(new)} now")
    return lines


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) and len(value) < 80 else str(value)

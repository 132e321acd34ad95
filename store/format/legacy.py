"""Format-1 records, upgraded in memory to the shape later versions give them (`manifest.py` reads
them; `format_version` keeps saying 1, so readers know which guarantees hold)."""

from __future__ import annotations

from typing import Any

# Version 1 wrote every task and artifact with all of kind, teacher, shard and row range (null or 0
# where a kind has none), a part record's LM-head facts as `info`, and had no checksums.
_V1_TASK_FIELDS = {
    "rows": ("task_id", "path", "row_start", "row_stop"),
    "lm_head": ("task_id", "path", "teacher"),
    "hidden": ("task_id", "path", "teacher", "shard", "row_start", "row_stop"),
}
_V1_ARTIFACT_FIELDS = ("task_id", "path", "rows", "tokens", "bytes", "hash", "part_sha256")


def _upgrade_v1_task(task: Any) -> Any:
    if not isinstance(task, dict) or task.get("kind") not in _V1_TASK_FIELDS:
        return task  # left for validation to reject
    return {"kind": task["kind"], **{k: task.get(k) for k in _V1_TASK_FIELDS[task["kind"]]}}


def _upgrade_v1_artifact(artifact: Any) -> Any:
    if not isinstance(artifact, dict):
        return artifact
    kind = str(artifact.get("kind"))
    keep = {"hidden": ("teacher", "shard"), "lm_head": ("teacher",)}.get(kind, ())
    return {"kind": artifact.get("kind"), **{k: artifact.get(k) for k in (*_V1_ARTIFACT_FIELDS, *keep)}}


def _upgrade_v1_storage(raw: dict[str, Any]) -> None:
    if isinstance(raw.get("storage"), dict):
        raw["storage"] = {**raw["storage"], "checksum": None}


def upgrade_v1_plan(raw: dict[str, Any]) -> dict[str, Any]:
    raw = dict(raw)
    if isinstance(raw.get("tasks"), list):
        raw["tasks"] = [_upgrade_v1_task(t) for t in raw["tasks"]]
    _upgrade_v1_storage(raw)
    return raw


def upgrade_v1_manifest(raw: dict[str, Any]) -> dict[str, Any]:
    raw = dict(raw)
    raw["rows"] = _upgrade_v1_artifact(raw.get("rows"))
    for key in ("lm_heads", "shards"):
        if isinstance(raw.get(key), list):
            raw[key] = [_upgrade_v1_artifact(a) for a in raw[key]]
    _upgrade_v1_storage(raw)
    return raw


def upgrade_v1_part(raw: Any) -> Any:
    if not isinstance(raw, dict) or "kind" not in raw:
        return raw
    info = raw.get("info") or None
    head = info if raw.get("kind") == "lm_head" else None
    dropped = {"kind", "path", "teacher", "shard", "info"}
    return {**{k: v for k, v in raw.items() if k not in dropped}, "head": head}

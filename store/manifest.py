"""Schemas of the store's JSON records: the plan, task part records and the manifest (format version 1).

- `_plan.json`: written once when a store is created; every later job must plan the same store.
- `_parts/<task_id>.json`: created no-clobber by a task after its output folder is durable.
- `manifest.json`: written last by finalize; the only thing readers trust.

All three are canonical JSON (sorted keys). Fields that legitimately differ between two runs that
computed the same bytes (time, host) live under `volatile` and are excluded from every comparison.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from mopd.store.errors import ManifestError

FORMAT = "mopd-teacher-store"
FORMAT_VERSION = 1
KNOWN_FEATURES: frozenset[str] = frozenset()

MANIFEST_FILE = "manifest.json"
PLAN_FILE = "_plan.json"
PARTS_DIR = "_parts"

TaskKind = Literal["rows", "lm_head", "hidden"]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskSpec(_Record):
    """One unit of work. `hidden` tasks cover teacher `teacher`'s rows in [row_start, row_stop)."""

    task_id: str
    kind: TaskKind
    path: str
    teacher: int | None = None
    shard: int | None = None
    row_start: int = 0
    row_stop: int = 0


class TeacherInfo(_Record):
    """What is known of a teacher before any forward pass."""

    index: int
    checkpoint: str
    aliases: list[str]
    fingerprint: str
    backend: str


class TeacherEntry(TeacherInfo):
    """A teacher as the manifest records it, with what its LM-head task measured."""

    hidden_size: int
    vocab_size: int
    dtype: str
    logit_scale: float | None = None
    final_logit_softcap: float | None = None


class TokenizerInfo(_Record):
    name: str
    vocab_hash: str
    vocab_size: int


class DatasetInfo(_Record):
    source: str
    fingerprint: str
    num_rows: int
    num_tokens: int


class StorageInfo(_Record):
    hidden_dtype: Literal["bfloat16", "float32"]
    codec: str
    chunk_bytes: int


class Plan(_Record):
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    tokenizer: TokenizerInfo
    dataset: DatasetInfo
    teachers: list[TeacherInfo]
    tasks: list[TaskSpec]
    storage: StorageInfo
    config: dict[str, Any]

    def identity(self) -> str:
        """Hash of everything that decides the store's bytes."""
        return sha256_json(self.model_dump(mode="json"))


class PartRecord(_Record):
    """A finished task: where its folder is and what is in it."""

    task_id: str
    identity: str
    kind: TaskKind
    path: str
    teacher: int | None = None
    shard: int | None = None
    num_rows: int
    num_tokens: int
    bytes: int
    hash: str
    files: dict[str, tuple[int, str]]
    info: dict[str, Any] = {}


class ArtifactRecord(_Record):
    """A published folder as the manifest lists it."""

    task_id: str
    kind: TaskKind
    path: str
    teacher: int | None = None
    shard: int | None = None
    rows: int
    tokens: int
    bytes: int
    hash: str
    part_sha256: str


class Manifest(_Record):
    format: str
    format_version: int
    required_features: list[str]
    created_by: str
    identity: str
    tokenizer: TokenizerInfo
    dataset: DatasetInfo
    teachers: list[TeacherEntry]
    storage: StorageInfo
    rows: ArtifactRecord
    lm_heads: list[ArtifactRecord]
    shards: list[ArtifactRecord]
    config: dict[str, Any]
    volatile: dict[str, Any] = {}

    def artifacts(self) -> list[ArtifactRecord]:
        return [self.rows, *self.lm_heads, *self.shards]

    def stable_dict(self) -> dict[str, Any]:
        """The manifest without its volatile fields: equal for every run that made the same store."""
        return self.model_dump(mode="json", exclude={"volatile"})


def canonical_json(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False) + "\n").encode()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def artifact_hash(files: dict[str, tuple[int, str]]) -> str:
    """The content hash of a folder: sha256 over its sorted (path, size, sha256) list."""
    return sha256_json(sorted([path, size, digest] for path, (size, digest) in files.items()))


def _load_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as err:
        raise ManifestError(f"{path}: the {what} does not parse ({err}); it is damaged") from err


def check_format(raw: Any, path: Path) -> None:
    """Checks format name, version and required features, in that order (DESIGN §4)."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise ManifestError(f"{path}: format is {found!r}, expected {FORMAT!r}; this is not a mopd store")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        fix = "upgrade mopd" if newer else "re-create the store with this mopd"
        raise ManifestError(
            f"{path}: format_version {version} is {'newer than' if newer else 'not read by'} this mopd "
            f"(reads {FORMAT_VERSION}); {fix}"
        )
    unknown = sorted(set(raw.get("required_features", [])) - KNOWN_FEATURES)
    if unknown:
        raise ManifestError(
            f"{path}: requires feature(s) {', '.join(unknown)} that this mopd does not know; upgrade mopd"
        )


def load_manifest(path: Path) -> Manifest:
    """Reads and validates `manifest.json`.

    Raises:
        FileNotFoundError: there is no manifest (the store is not finalized).
        ManifestError: it does not parse, has an unsupported format or version, or misses fields.
    """
    raw = _load_json(path, "manifest")
    check_format(raw, path)
    try:
        return Manifest.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        raise ManifestError(f"{path}: malformed manifest: {first['loc']}: {first['msg']}") from err


def load_plan(path: Path) -> Plan:
    raw = _load_json(path, "plan")
    check_format(raw, path)
    try:
        return Plan.model_validate(raw)
    except ValidationError as err:
        raise ManifestError(f"{path}: malformed plan: {err}") from err


def load_part(path: Path) -> PartRecord:
    try:
        return PartRecord.model_validate(_load_json(path, "part record"))
    except ValidationError as err:
        raise ManifestError(f"{path}: malformed part record: {err}") from err

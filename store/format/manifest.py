"""Schemas of the store's JSON records: the plan, task part records and the manifest (format version 4),
each canonical JSON, the manifest the only thing readers trust (docs/internals.md, docs/store-format.md).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_serializer,
)

from mopd.base.errors import ManifestError
from mopd.base.jsonio import parse_json, validated
from mopd.store.format.teachers import TeacherIdentity

FORMAT = "mopd-teacher-store"
FORMAT_VERSION = 4
# `storage.encoding`: hidden states as computed, or 8-bit codes (`codec/int8_rotated.py`); a store of the
# latter requires the feature of that name of its readers.
EXACT, INT8_ROTATED = "exact", "int8-rotated"
# A store with teachers of other tokenizers (DESIGN §13): their shards hold their own token rows and the
# alignment of each row's two tokenisations.
CROSS_TOKENIZER = "cross-tokenizer"
# A store whose rows may have several teachers (DESIGN §14): its rows hold each row's set.
TEACHER_SETS = "teacher-sets"
KNOWN_FEATURES: frozenset[str] = frozenset({INT8_ROTATED, CROSS_TOKENIZER, TEACHER_SETS})

MANIFEST_FILE = "manifest.json"
CALIBRATION_FILE = "calibration.json"  # an encoding task's `EncodingInfo`, in its folder
PLAN_FILE = "_plan.json"
PARTS_DIR = "_parts"


# Counts, sizes, indices and positions: JSON integers ≥ 0 (never a bool, a float or a numeric string).
Count = Annotated[StrictInt, Field(ge=0)]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # Fields added to format 4 after its first stores were written: left out of the JSON while they hold
    # their default, so that such a record is byte for byte what an earlier mopd wrote (same hashes).
    OMITTED_AT_DEFAULT: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        for name in self.OMITTED_AT_DEFAULT:
            if getattr(self, name) == type(self).model_fields[name].default:
                data.pop(name, None)
        return data


class RowsTask(_Record):
    """The rows: tokens, loss masks, teacher index and source key of rows [row_start, row_stop)."""

    kind: Literal["rows"] = "rows"
    task_id: str
    path: str
    row_start: Count = 0
    row_stop: Count


class HeadTask(_Record):
    """One teacher's LM head."""

    kind: Literal["lm_head"] = "lm_head"
    task_id: str
    path: str
    teacher: Count


class ShardTask(_Record):
    """Teacher `teacher`'s hidden states of its rows in [row_start, row_stop): its shard `shard`."""

    kind: Literal["hidden"] = "hidden"
    task_id: str
    path: str
    teacher: Count
    shard: Count
    row_start: Count
    row_stop: Count


class EncodingTask(_Record):
    """Teacher `teacher`'s encoding of an int8-rotated store: its mean and rotation, fitted on the rows of
    its first shard. A job runs it before its first shard of the teacher unless another job has."""

    kind: Literal["encoding"] = "encoding"
    task_id: str
    path: str
    teacher: Count


class ProjectionTask(_Record):
    """Teacher `teacher`'s projection onto the store's vocabulary, for a teacher of another tokenizer
    (`mopd.tokens.projection.first_token_projection`): computed from the two tokenizers, no forward."""

    kind: Literal["projection"] = "projection"
    task_id: str
    path: str
    teacher: Count


TaskSpec = Annotated[
    RowsTask | HeadTask | ShardTask | EncodingTask | ProjectionTask, Field(discriminator="kind")
]


class TokenizerInfo(_Record):
    """A tokenizer: its vocabulary's hash and size and, in a store with teachers of other tokenizers,
    its `fingerprint` (`mopd.tokens.pieces.tokenizer_fingerprint`: what decides its tokenisation)."""

    OMITTED_AT_DEFAULT = ("fingerprint",)

    name: str
    vocab_hash: str
    vocab_size: Count
    fingerprint: str = ""


class TeacherInfo(_Record):
    """What is known of a teacher before any forward pass. `tokenizer`: its own, where it is not the
    store's (a teacher of another tokenizer); None where it shares the store's vocabulary."""

    OMITTED_AT_DEFAULT = ("tokenizer",)

    index: Count
    checkpoint: str
    aliases: list[str]
    fingerprint: str
    backend: str
    tokenizer: TokenizerInfo | None = None


class HeadInfo(_Record):
    """What an LM-head task measured of its teacher."""

    vocab_size: Count
    hidden_size: Count
    dtype: Literal["bfloat16", "float32"]
    logit_scale: StrictFloat | None = None
    final_logit_softcap: StrictFloat | None = None


class TeacherEntry(TeacherInfo, HeadInfo):
    """A teacher as the manifest records it, with what its LM-head task measured."""


class DatasetInfo(_Record):
    OMITTED_AT_DEFAULT = ("teacher_sets",)

    source: str
    fingerprint: str
    num_rows: Count
    num_tokens: Count
    # Some row has several teachers: the rows hold each row's set (`layout.TEACHER_SET`).
    teacher_sets: StrictBool = False


class StorageInfo(_Record):
    OMITTED_AT_DEFAULT = ("encoding",)

    hidden_dtype: Literal["bfloat16", "float32"]
    codec: Literal["shuffle-zstd1", "none"]
    chunk_bytes: Annotated[StrictInt, Field(gt=0)]
    checksum: Literal["crc32c"] = "crc32c"  # of every inner chunk
    # How hidden states are stored: `exact` in `hidden_dtype`, or 8-bit codes (`codec/int8_rotated.py`).
    encoding: Literal["exact", "int8-rotated"] = "exact"


class EncodingInfo(_Record):
    """What an encoding task fitted and measured (its folder's `calibration.json`): the rotation's seed,
    the calibration rows, and the KL (nats per token, T = 1) of the distribution rebuilt from the decoded
    states from the exact one, on the first calibration tokens."""

    seed: Count
    calibration_rows: Count
    calibration_tokens: Count
    measured_tokens: Count
    kl_mean: StrictFloat
    kl_p99: StrictFloat
    kl_max: StrictFloat
    top1_agreement: StrictFloat


class DataSettings(_Record):
    """How the dataset was tokenised into the store's rows."""

    max_length: StrictInt
    overlong: str
    input_format: str


class PrecomputeSettings(_Record):
    """How the teachers ran."""

    rows_per_task: Count
    compute_dtype: str
    trust_remote_code: StrictBool


class StoreSettings(_Record):
    """The settings of the job that created the store that decide its rows and bytes (the plan's
    `config`). A synthetic store (tests, benchmarks) records none of them."""

    OMITTED_AT_DEFAULT = ("data", "routing", "precompute")

    data: DataSettings | None = None
    # The config's `routing` section as JSON (the store does not import the config's models).
    routing: dict[str, Any] | None = None
    precompute: PrecomputeSettings | None = None


class Plan(_Record):
    format: Literal["mopd-teacher-store"] = "mopd-teacher-store"
    format_version: Count = FORMAT_VERSION
    tokenizer: TokenizerInfo
    dataset: DatasetInfo
    teachers: list[TeacherInfo]
    tasks: list[TaskSpec]
    storage: StorageInfo
    config: StoreSettings
    # The whole config of the job that created the store, command-line overrides included (its settings
    # that differ from their defaults): what it ran with. Not part of the identity: jobs may differ here.
    created_with: dict[str, Any] = {}

    def identity(self) -> str:
        """Hash of everything that decides the store's bytes."""
        return sha256_json(self.model_dump(mode="json", exclude={"created_with"}))


class AlignmentCounts(_Record):
    """A shard of a teacher of another tokenizer: its rows' trained student positions, those aligned
    with a teacher position, and those aligned or inside a span (what precompute logs, `mopd inspect`
    and `mopd train` report as shares)."""

    trained: Count
    aligned: Count
    reached: Count

    def __add__(self, other: AlignmentCounts) -> AlignmentCounts:
        return AlignmentCounts(
            trained=self.trained + other.trained,
            aligned=self.aligned + other.aligned,
            reached=self.reached + other.reached,
        )


class PartRecord(_Record):
    """A finished task: its counts and every file of its folder (relative path → size, sha256)."""

    task_id: str
    identity: str
    num_rows: Count
    num_tokens: Count
    bytes: Count
    hash: str
    files: dict[str, tuple[Count, str]]
    head: HeadInfo | None = None  # LM-head tasks only
    # A shard of a teacher of another tokenizer: the student positions its alignment arrays cover, and
    # how many of the trained ones its teacher supervises.
    aligned_tokens: Count = 0
    alignment: AlignmentCounts | None = None

    OMITTED_AT_DEFAULT = ("aligned_tokens", "alignment")


class _Published(_Record):
    """A published task folder as the manifest lists it."""

    task_id: str
    path: str
    rows: Count
    tokens: Count
    bytes: Count
    hash: str
    part_sha256: str


class RowsArtifact(_Published):
    kind: Literal["rows"] = "rows"


class HeadArtifact(_Published):
    kind: Literal["lm_head"] = "lm_head"
    teacher: Count


class ShardArtifact(_Published):
    OMITTED_AT_DEFAULT = ("aligned_tokens", "alignment")

    kind: Literal["hidden"] = "hidden"
    teacher: Count
    shard: Count
    aligned_tokens: Count = 0  # as its part record's
    alignment: AlignmentCounts | None = None  # as its part record's


class EncodingArtifact(_Published):
    kind: Literal["encoding"] = "encoding"
    teacher: Count


class ProjectionArtifact(_Published):
    """A published projection: `tokens` counts its entries (it has no rows)."""

    kind: Literal["projection"] = "projection"
    teacher: Count


ArtifactRecord = RowsArtifact | HeadArtifact | ShardArtifact | EncodingArtifact | ProjectionArtifact


def aligned_shares(manifest: Manifest) -> dict[int, tuple[float, float]]:
    """teacher → (the share of its trained positions with an aligned teacher position, the share
    aligned or inside a span), for each teacher of another tokenizer, from its shards' records."""
    counts: dict[int, AlignmentCounts] = {}
    for shard in manifest.shards:
        if shard.alignment is not None:
            counts[shard.teacher] = (
                counts[shard.teacher] + shard.alignment if shard.teacher in counts else shard.alignment
            )
    return {t: (c.aligned / c.trained, c.reached / c.trained) for t, c in sorted(counts.items()) if c.trained}


class Manifest(_Record):
    OMITTED_AT_DEFAULT = ("encodings", "projections")

    format: Literal["mopd-teacher-store"]
    format_version: Count
    required_features: list[str]
    created_by: str
    identity: str
    tokenizer: TokenizerInfo
    dataset: DatasetInfo
    teachers: list[TeacherEntry]
    storage: StorageInfo
    rows: RowsArtifact
    lm_heads: list[HeadArtifact]
    shards: list[ShardArtifact]
    encodings: list[EncodingArtifact] = []  # int8-rotated stores: one per teacher with rows
    projections: list[ProjectionArtifact] = []  # one per teacher of another tokenizer
    config: StoreSettings
    volatile: dict[str, Any] = {}

    def teacher_list(self) -> list[TeacherIdentity]:
        """What each teacher index means (checkpoint and fingerprint): what a checkpoint records and a
        resume compares."""
        return [TeacherIdentity(t.index, t.checkpoint, t.fingerprint) for t in self.teachers]

    def artifacts(self) -> list[ArtifactRecord]:
        return [self.rows, *self.lm_heads, *self.encodings, *self.projections, *self.shards]

    def stable_dict(self) -> dict[str, Any]:
        """The manifest without its volatile fields: equal for every run that made the same store."""
        return self.model_dump(mode="json", exclude={"volatile"})

    def hash(self) -> str:
        """sha256 of the stable manifest: the store's identity as a training checkpoint records it."""
        return sha256_json(self.stable_dict())


def canonical_json(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False, allow_nan=False) + "\n").encode()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def artifact_hash(files: dict[str, tuple[int, str]]) -> str:
    """The content hash of a folder: sha256 over its sorted (path, size, sha256) list."""
    return sha256_json(sorted([path, size, digest] for path, (size, digest) in files.items()))


def check_format(raw: Any, path: str | Path) -> int:
    """Checks format name, version and required features, in that order (DESIGN §4); returns the version."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise ManifestError(f"{path}: format is {found!r}, expected {FORMAT!r}; this is not a mopd store")
    version = raw.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version != FORMAT_VERSION:
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise ManifestError(
                f"{path}: format_version {version} is newer than this mopd (reads {FORMAT_VERSION}); "
                "upgrade mopd"
            )
        raise ManifestError(
            f"{path}: format_version {version} is a store format this mopd does not read (it reads "
            f"{FORMAT_VERSION}; versions 1-3 were written before mopd 0.1.0); rebuild the store with "
            "`mopd precompute`"
        )
    features = raw.get("required_features", [])
    if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
        raise ManifestError(f"{path}: required_features must be a list of names")
    unknown = sorted(set(features) - KNOWN_FEATURES)
    if unknown:
        raise ManifestError(
            f"{path}: requires feature(s) {', '.join(unknown)} that this mopd does not know; upgrade mopd"
        )
    return version


def _validate(model: type[BaseModel], raw: Any, path: str | Path, what: str) -> Any:
    return validated(model, raw, what=f"{path}: malformed {what}", error=ManifestError)


# A damaged manifest is rebuilt from the part records, which finalize reads again.
REBUILD_MANIFEST = (
    "delete it and run `mopd precompute` again with the store's config: every task is done, so it only "
    "rebuilds the manifest from the tasks' records"
)


def parse_manifest(data: bytes, path: str | Path) -> Manifest:
    """Validates the bytes of `manifest.json`.

    Raises:
        ManifestError: they do not parse, have an unsupported format or version, or miss fields.
    """
    try:
        raw = parse_json(data, what=f"manifest {path}", error=ManifestError)
    except ManifestError as err:
        raise ManifestError(f"{err}; {REBUILD_MANIFEST}") from err
    check_format(raw, path)
    try:
        manifest: Manifest = _validate(Manifest, raw, path, "manifest")
    except ManifestError as err:
        raise ManifestError(f"{err}; {REBUILD_MANIFEST}") from err
    return manifest


def parse_calibration(data: bytes, path: str | Path) -> EncodingInfo:
    """An encoding task's `calibration.json`."""
    raw = parse_json(data, what=f"calibration record {path}", error=ManifestError)
    info: EncodingInfo = _validate(EncodingInfo, raw, path, "calibration record")
    return info


def parse_plan(data: bytes, path: str | Path) -> Plan:
    raw = parse_json(data, what=f"plan {path}", error=ManifestError)
    check_format(raw, path)
    plan: Plan = _validate(Plan, raw, path, "plan")
    return plan


def parse_part(data: bytes, path: str | Path) -> PartRecord:
    raw = parse_json(data, what=f"part record {path}", error=ManifestError)
    part: PartRecord = _validate(PartRecord, raw, path, "part record")
    return part

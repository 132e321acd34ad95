"""Ingest once, stream after: the tokenised rows as an Arrow file that every precompute job shares.

The first job to need the rows tokenises the dataset (`data.tokenize_dataset`: a batched `datasets.map`
over `data.num_proc` processes, with a progress bar) and publishes them as `STORE/ingest/<key>/`
(`rows.arrow` and `ingest.json`, written under a temporary name and renamed into place). Every later
job — each job of a SLURM array, each resume — finds that folder and memory-maps it, so it tokenises
nothing and holds in memory only the row metadata and the rows its own tasks read.

The key is a hash of everything that decides the rows: the source files' bytes, the tokenizer's files,
`data.max_length`, `data.overlong` and the routing from agent to teacher index. Equal keys give equal
rows (the tokenisation is a pure function of them), so two jobs that ingest at once publish the same
bytes and either's folder serves. The folder is a cache beside the store, not part of it: the manifest
does not list it, `verify-manifest` does not read it, and deleting it costs one ingest.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

from mopd.base import faults
from mopd.base.errors import ConfigError
from mopd.base.fsio import files_digest, fsync_path, is_temporary
from mopd.base.jsonio import parse_json
from mopd.config.mopd_config import MopdConfig
from mopd.config.precompute import DataConfig, RoutingConfig
from mopd.precompute.cross_rows import CrossTokenizers, aligned_shares
from mopd.precompute.data import tokenize_dataset
from mopd.precompute.records import load_records
from mopd.precompute.rows import TokenizedRows
from mopd.precompute.teachers import TeacherSet, load_tokenizer
from mopd.store.format.fingerprint import TOKENIZER_FILES
from mopd.store.format.manifest import canonical_json
from mopd.store.format.provenance import INGEST_DIR, INGEST_RECORD
from mopd.store.locations.location import Location
from mopd.tokens.alignment import shares_line

INGEST_VERSION = 1
ROWS_FILE = "rows.arrow"
_BATCH_ROWS = 1 << 16
_STALE_SECONDS = 3600  # a temporary folder untouched this long belongs to a killed ingest


def ingest_key(
    *,
    data: DataConfig,
    routing: RoutingConfig,
    agent_to_alias: Mapping[str, str | list[str]],
    alias_index: Mapping[str, int],
    tokenizer_path: str,
    contexts: Mapping[int, int],
    cross_tokenizers: Mapping[int, str] | None = None,
) -> tuple[str, dict[str, Any]]:
    """The cache key and what it hashes: everything that decides the tokenised rows (the tokenizers of
    teachers of other tokenizers too, where there are any)."""
    source = Path(data.path)
    inputs = {
        "version": INGEST_VERSION,
        "source": files_digest(source),
        "tokenizer": files_digest(Path(tokenizer_path), list(TOKENIZER_FILES)),
        "max_length": data.max_length,
        "overlong": data.overlong,
        "routing_field": routing.field,
        "teacher_by_agent": {
            agent: _indices(aliases, alias_index) for agent, aliases in sorted(agent_to_alias.items())
        },
        "default_teacher": _indices(routing.default_teacher, alias_index)
        if routing.default_teacher
        else None,
        "teacher_contexts": {str(t): n for t, n in sorted(contexts.items())},
    }
    if routing.teachers_field is not None:
        inputs["teachers_field"] = routing.teachers_field
    if cross_tokenizers:
        inputs["cross_tokenizers"] = {
            str(t): files_digest(Path(path), list(TOKENIZER_FILES))
            for t, path in sorted(cross_tokenizers.items())
        }
    return hashlib.sha256(canonical_json(inputs)).hexdigest()[:32], inputs


def _indices(aliases: str | list[str], alias_index: Mapping[str, int]) -> int | list[int]:
    """An alias's teacher index, or a list's indices (ascending, each once)."""
    if isinstance(aliases, str):
        return alias_index[aliases]
    return sorted({alias_index[a] for a in aliases})


def open_ingested(folder: Path) -> TokenizedRows:
    """The published rows of an ingest folder, memory-mapped."""
    meta = parse_json(
        (folder / INGEST_RECORD).read_bytes(), what=str(folder / INGEST_RECORD), error=ConfigError
    )
    with pa.memory_map(str(folder / ROWS_FILE)) as source:
        table = pa.ipc.open_file(source).read_all()
    return TokenizedRows(table, meta["rows"])


def _remove_stale(cache: Path) -> None:
    for path in cache.iterdir() if cache.is_dir() else ():
        if not is_temporary(path.name):
            continue
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:  # another job published or removed it since the listing
            continue
        if age > _STALE_SECONDS:
            shutil.rmtree(path, ignore_errors=True)


def _publish(rows: TokenizedRows, inputs: dict[str, Any], work: Path, folder: Path) -> None:
    """Writes the rows and their record into `work`, then renames it to `folder` (durably)."""
    # Batches of a fixed row count, whatever chunks `map` made, and no schema metadata (datasets puts a
    # random fingerprint there): the file's bytes are a function of the rows alone, so every job that
    # ingests publishes the same file.
    table = rows.table.replace_schema_metadata(None)
    rows_file = work / ROWS_FILE
    with (
        faults.io("write", rows_file),
        pa.OSFile(str(rows_file), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as out,
    ):
        for start in range(0, table.num_rows, _BATCH_ROWS):
            out.write_batch(table.slice(start, _BATCH_ROWS).combine_chunks().to_batches()[0])
    with faults.io("write", work / INGEST_RECORD):
        (work / INGEST_RECORD).write_bytes(canonical_json({"inputs": inputs, "rows": rows.meta}))
    del table
    for path in work.glob("map*.arrow"):  # unlinked while the caller's rows still map them: Linux keeps
        path.unlink()  # a mapped file's pages until the mapping goes
    for path in (work / ROWS_FILE, work / INGEST_RECORD, work):
        fsync_path(path)
    try:
        os.rename(work, folder)
    except OSError as err:  # another job published the same rows first: its folder serves
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    fsync_path(folder.parent)


def ingest(
    *,
    data: DataConfig,
    routing: RoutingConfig,
    agent_to_alias: Mapping[str, str | list[str]],
    alias_index: Mapping[str, int],
    tokenizer_path: str,
    load_tokenizer: Callable[[], Any],
    contexts: Mapping[int, int],
    cache: Path,
    cross_tokenizers: Mapping[int, str] | None = None,
    load_cross: Callable[[Any], CrossTokenizers | None] = lambda student: None,
    num_proc: int | None,
    show_progress: bool,
    log: Callable[[str], Any],
) -> TokenizedRows:
    """The dataset's tokenised rows: from the cache if a job made them, else tokenised and published.

    Raises:
        ConfigError: as `tokenize_dataset` (bad data, columns or routing).
    """
    key, inputs = ingest_key(
        data=data,
        routing=routing,
        agent_to_alias=agent_to_alias,
        alias_index=alias_index,
        tokenizer_path=tokenizer_path,
        contexts=contexts,
        cross_tokenizers=cross_tokenizers,
    )
    folder = cache / key
    if (folder / INGEST_RECORD).exists():
        rows = open_ingested(folder)
        log(f"ingest: reading the tokenised rows of {data.path} from {folder} ({rows.num_rows:,} rows)")
        return rows
    cache.mkdir(parents=True, exist_ok=True)
    _remove_stale(cache)
    work = cache / f"{key}.tmp-{uuid.uuid4().hex}"
    work.mkdir()
    try:
        started = time.perf_counter()
        student = load_tokenizer()
        with faults.io("write", work / "map.arrow", unnamed_only=True):  # the map's buffered output
            rows = tokenize_dataset(
                load_records(data.path),
                data=data,
                routing=routing,
                agent_to_alias=agent_to_alias,
                alias_index=alias_index,
                tokenizer=student,
                contexts=contexts,
                num_proc=num_proc,
                show_progress=show_progress,
                cache_file=work / "map.arrow",
                cross=load_cross(student),
            )
        _publish(rows, inputs, work, folder)
        del rows  # the map's files went; the published copy is read back memory-mapped
        seconds = time.perf_counter() - started
        log(f"ingest: tokenised {data.path} in {seconds:.1f} s; the rows are cached in {folder}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return open_ingested(folder)


def ingest_cache(location: Location) -> Path:
    """Where the tokenised rows are kept: inside a store on a filesystem, so that every job of the store
    reads what the first one made; on this machine for a store in a bucket (each machine tokenises once),
    whose ingest records are copied into the store (`publish_ingest_records`)."""
    return location.machine_cache(INGEST_DIR)


def publish_ingest_records(location: Location, cache: Path) -> None:
    """Copies the ingest records of a store in a bucket into it, where `store.provenance` reads them: the
    published ones, not another job's temporary (renamed or removed at any moment)."""
    if location.local_folder() is None:
        for record in sorted(cache.glob(f"*/{INGEST_RECORD}")):
            if not is_temporary(record.parent.name):
                location.write_same(f"{INGEST_DIR}/{record.parent.name}/{INGEST_RECORD}", record.read_bytes())


def load_cross_tokenizers(
    student: Any, teachers: TeacherSet, trust_remote_code: bool
) -> CrossTokenizers | None:
    """The tokenizers of the teachers of other tokenizers, with their token tables; None without any."""
    if not teachers.cross:
        return None
    own = {t: load_tokenizer(path, trust_remote_code=trust_remote_code) for t, path in teachers.cross.items()}
    return CrossTokenizers.of(student, own)


def ingest_rows(
    config: MopdConfig,
    teachers: TeacherSet,
    cache: Path,
    *,
    show_progress: bool,
    log: Callable[[str], Any],
) -> TokenizedRows:
    """The dataset's rows, tokenised and routed; the first job of a store ingests, later ones read.

    Raises:
        ConfigError: as `ingest`, or a dataset without a trained token.
    """
    trust_remote_code = config.precompute.trust_remote_code
    rows = ingest(
        data=config.data,
        routing=config.routing,
        agent_to_alias=config.agent_to_alias(),
        alias_index=teachers.alias_index,
        tokenizer_path=teachers.tokenizer_path,
        contexts=teachers.contexts,
        load_tokenizer=lambda: load_tokenizer(teachers.tokenizer_path, trust_remote_code=trust_remote_code),
        cache=cache,
        cross_tokenizers=teachers.cross,
        load_cross=lambda student: load_cross_tokenizers(student, teachers, trust_remote_code),
        num_proc=config.data.num_proc or min(8, os.cpu_count() or 1),
        show_progress=show_progress,
        log=log,
    )
    names = {s.index: "+".join(s.aliases) for s in teachers.slots}
    others = rows.other_tokenizer(teachers.cross)
    for teacher, (aligned, either) in aligned_shares(rows.table, others).items():
        log(shares_line(names[teacher], aligned, either))
    if rows.num_trained == 0:
        raise ConfigError(
            f"data.path {config.data.path}: none of its {rows.num_rows} rows has a trained token (every "
            "loss_mask is 0), so a store of it would distil nothing; mark the tokens to train with "
            "loss_mask, or use prompt/completion or messages rows"
        )
    return rows

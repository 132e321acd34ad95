"""The store's plan of a precompute job: everything that decides the store's bytes (tokenizers, dataset,
teachers, tasks, storage, settings), so that equal plans give equal stores and every job of a store
must plan the same one."""

from __future__ import annotations

from mopd.base.devices import resolve_device
from mopd.config.mopd_config import MopdConfig
from mopd.config.precompute import PrecomputeConfig
from mopd.precompute.output_layer import resolve_dtype
from mopd.precompute.rows import TokenizedRows
from mopd.precompute.teachers import TeacherSet, tokenizer_info
from mopd.store.format.layout import plan_tasks
from mopd.store.format.manifest import (
    DatasetInfo,
    DataSettings,
    Plan,
    PrecomputeSettings,
    StorageInfo,
    StoreSettings,
    TeacherInfo,
    TokenizerInfo,
)

# The inner chunk: the unit a read decodes (bench/README.md, "scale.py", measures the choice).
CHUNK_BYTES = 256 << 10


def build_plan(
    config: MopdConfig, teachers: TeacherSet, rows: TokenizedRows, backend: str, compute_dtype: str
) -> Plan:
    """The store's plan; everything in it decides the store's bytes, so equal plans give equal stores."""
    trust = config.precompute.trust_remote_code
    own = {t: tokenizer_info(path, trust_remote_code=trust) for t, path in teachers.cross.items()}
    # With teachers of other tokenizers, the store's tokenizer is bound by its fingerprint too: the
    # alignments hold for it alone.
    fingerprint = tokenizer_info(teachers.tokenizer_path, trust_remote_code=trust).fingerprint if own else ""
    return Plan(
        tokenizer=TokenizerInfo(
            name=teachers.tokenizer_path,
            vocab_hash=teachers.vocab_hash,
            vocab_size=teachers.vocab_size,
            fingerprint=fingerprint,
        ),
        dataset=dataset_info(config, rows),
        teachers=[
            TeacherInfo(
                index=s.index,
                checkpoint=s.checkpoint,
                aliases=list(s.aliases),
                fingerprint=teachers.fingerprints[s.index],
                backend=backend,
                tokenizer=own.get(s.index),
            )
            for s in teachers.slots
        ],
        tasks=plan_tasks(
            rows.teacher_index,
            num_teachers=len(teachers.slots),
            rows_per_task=config.precompute.rows_per_task,
            encoding=config.store.encoding,
            cross=teachers.cross,
            teacher_set=rows.teacher_set,
        ),
        storage=StorageInfo(
            hidden_dtype=config.store.dtype,
            codec=config.store.codec,
            chunk_bytes=CHUNK_BYTES,
            encoding=config.store.encoding,
        ),
        config=StoreSettings(
            data=DataSettings(
                max_length=config.data.max_length,
                overlong=config.data.overlong,
                input_format=rows.input_format,
            ),
            routing=config.routing.model_dump(mode="json"),
            precompute=PrecomputeSettings(
                rows_per_task=config.precompute.rows_per_task,
                compute_dtype=compute_dtype,
                trust_remote_code=config.precompute.trust_remote_code,
            ),
        ),
        created_with=config.model_dump(mode="json", exclude_defaults=True),
    )


def compute_dtype(settings: PrecomputeConfig) -> str:
    """The dtype the teachers compute in, as the plan records it."""
    return str(resolve_dtype(settings.dtype, resolve_device(settings.device))).removeprefix("torch.")


def dataset_info(config: MopdConfig, rows: TokenizedRows) -> DatasetInfo:
    return DatasetInfo(
        source=config.data.path,
        fingerprint=rows.fingerprint(),
        num_rows=rows.num_rows,
        num_tokens=int(rows.lengths.sum()),
        teacher_sets=rows.teacher_set is not None,
    )

"""Synthetic teachers and stores for store tests: real files, real zarr, random but reproducible values.

`hidden_for(row, teacher, length, hidden_size, dtype)` is a pure function, so a test can rebuild the
expected payload of any row without keeping it. Runnable as a script (`python synthetic.py SPEC.json`)
so crash tests can SIGKILL a real writer process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from mopd.store.format.fingerprint import checkpoint_fingerprint, vocab_hash
from mopd.store.format.layout import plan_tasks, shard_rows
from mopd.store.format.manifest import (
    DatasetInfo,
    HeadTask,
    Plan,
    RowsTask,
    StorageInfo,
    StoreSettings,
    TeacherInfo,
    TokenizerInfo,
)
from mopd.store.format.teachers import alias_to_index, assign_teacher_indices
from mopd.store.task_writers import HiddenShardWriter, pack_rows, write_lm_head, write_rows
from mopd.store.writer import StoreWriter

VOCAB_SIZE = 300


def make_checkpoint(
    folder: Path,
    *,
    hidden_size: int,
    seed: int,
    vocab_size: int = VOCAB_SIZE,
    softcap: float | None = None,
    tied: bool = False,
) -> Path:
    """A checkpoint folder with config.json, tokenizer.json and a safetensors LM head."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "_name_or_path": str(folder),
    }
    if softcap is not None:
        config["final_logit_softcapping"] = softcap
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {f"tok{i}": i for i in range(vocab_size)}
    (folder / "tokenizer.json").write_text(
        json.dumps({"model": {"type": "WordLevel", "vocab": vocab}, "added_tokens": []})
    )
    generator = torch.Generator().manual_seed(seed)
    head = torch.randn(vocab_size, hidden_size, generator=generator)
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    save_file({name: head.to(torch.bfloat16)}, folder / "model.safetensors")
    return folder


def hidden_for(row: int, teacher: int, length: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1_000_003 * row + teacher)
    return (torch.randn(length, hidden_size, generator=generator) * 2.0).to(dtype)


def head_for(teacher: int, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(77 + teacher)
    return torch.randn(vocab_size, hidden_size, generator=generator).to(dtype)


@dataclass
class StoreSpec:
    """Everything that decides a synthetic store."""

    root: str
    teachers: dict[str, str]  # alias -> checkpoint folder
    hidden_sizes: dict[str, int]  # checkpoint folder -> hidden size
    agents: list[str]  # one per row; agent == alias
    lengths: list[int]
    dtype: str = "float32"
    rows_per_task: int = 4
    chunk_bytes: int = 1 << 16
    codec: str = "shuffle-zstd1"
    softcaps: dict[str, float] = field(default_factory=dict)  # checkpoint -> final_logit_softcap
    kill_in_task: str | None = None  # SIGKILL this process in the middle of that task
    only_tasks: list[str] | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32


def tokens_for(row: int, length: int) -> np.ndarray:
    return (np.arange(length, dtype=np.int64) * 7 + row) % VOCAB_SIZE


def build_plan(spec: StoreSpec) -> tuple[Plan, np.ndarray, dict[int, int]]:
    slots = assign_teacher_indices(spec.teachers)
    index_of_alias = alias_to_index(slots)
    teacher_index = np.array([index_of_alias[a] for a in spec.agents], dtype=np.int64)
    hidden_sizes = {slot.index: spec.hidden_sizes[slot.checkpoint] for slot in slots}
    first = slots[0].checkpoint
    plan = Plan(
        tokenizer=TokenizerInfo(name=first, vocab_hash=vocab_hash(first), vocab_size=VOCAB_SIZE),
        dataset=DatasetInfo(
            source="synthetic",
            fingerprint=f"lengths-{sum(spec.lengths)}",
            num_rows=len(spec.lengths),
            num_tokens=sum(spec.lengths),
        ),
        teachers=[
            TeacherInfo(
                index=s.index,
                checkpoint=s.checkpoint,
                aliases=list(s.aliases),
                fingerprint=checkpoint_fingerprint(s.checkpoint),
                backend="synthetic",
            )
            for s in slots
        ],
        tasks=plan_tasks(teacher_index, num_teachers=len(slots), rows_per_task=spec.rows_per_task),
        storage=StorageInfo(hidden_dtype=spec.dtype, codec=spec.codec, chunk_bytes=spec.chunk_bytes),
        config=StoreSettings(),
    )
    return plan, teacher_index, hidden_sizes


def build_store(spec: StoreSpec) -> StoreWriter:
    """Runs every (or every selected) task of the synthetic store, skipping finished ones; finalizes."""
    plan, teacher_index, hidden_sizes = build_plan(spec)
    writer = StoreWriter.open(spec.root, plan)
    done = writer.done_tasks()
    lengths = np.array(spec.lengths, dtype=np.int64)
    checkpoints = {t.index: t.checkpoint for t in plan.teachers}
    for task in plan.tasks:
        if task.task_id in done or (spec.only_tasks is not None and task.task_id not in spec.only_tasks):
            continue
        with writer.task(task.task_id) as out:
            if isinstance(task, RowsTask):
                input_ids, offsets = pack_rows([tokens_for(i, n) for i, n in enumerate(spec.lengths)])
                loss_mask, _ = pack_rows([(np.arange(n) % 3 != 0).astype(np.uint8) for n in spec.lengths])
                write_rows(
                    out,
                    input_ids=[input_ids],
                    loss_mask=[loss_mask],
                    offsets=offsets,
                    teacher_index=teacher_index,
                    source_keys=[f"row-{i}" for i in range(len(lengths))],
                )
            elif isinstance(task, HeadTask):
                write_lm_head(
                    out,
                    head_for(task.teacher, VOCAB_SIZE, hidden_sizes[task.teacher], spec.torch_dtype),
                    final_logit_softcap=spec.softcaps.get(checkpoints[task.teacher]),
                )
            else:
                rows = shard_rows(teacher_index, task)
                shard = HiddenShardWriter(
                    out,
                    row_ids=rows,
                    lengths=lengths[rows],
                    hidden_size=hidden_sizes[task.teacher],
                    dtype=spec.dtype,
                )
                for k, row in enumerate(rows):
                    if spec.kill_in_task == task.task_id and k == len(rows) // 2:
                        os.kill(os.getpid(), signal.SIGKILL)
                    shard.append(
                        int(row),
                        hidden_for(
                            int(row),
                            task.teacher,
                            int(lengths[row]),
                            hidden_sizes[task.teacher],
                            spec.torch_dtype,
                        ),
                    )
                shard.close()
    writer.finalize(created_by="mopd-tests", volatile={"host": "test"})
    return writer


def spec_to_json(spec: StoreSpec) -> str:
    return json.dumps(spec.__dict__)


if __name__ == "__main__":
    build_store(StoreSpec(**json.loads(Path(sys.argv[1]).read_text())))

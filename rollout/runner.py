"""`mopd rollout`: the student samples completions of every prompt; a dataset `mopd precompute` reads.

The work is done in parts of `rollout.prompts_per_part` prompts, each written whole (temp, fsync,
rename) to `<output>.parts/` next to a record of what it was sampled from. A rerun keeps the parts of
the same rollout and samples the rest; parts of another (other student, prompts or settings) are
removed first. The dataset itself is written last, the same way, and the parts removed: a dataset at
the output path is always a finished one.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from mopd.base.errors import ConfigError
from mopd.base.fsio import write_replace
from mopd.config.mopd_config import MopdConfig
from mopd.config.rollout import RolloutConfig
from mopd.precompute.teachers import load_tokenizer, tokenizer_checkpoint
from mopd.rollout.prompts import Prompt, PromptSet, read_prompts
from mopd.rollout.rows import (
    check_output_suffix,
    read_part,
    row_schema,
    sample_row,
    sample_seed,
    write_dataset,
    write_part,
)
from mopd.rollout.samplers import Completion, Sampler, load_sampler, stop_token_ids
from mopd.store.format.fingerprint import checkpoint_fingerprint, vocab_hash

Log = Callable[[str], None]
SETTINGS_FILE = "rollout.json"


@dataclass(frozen=True)
class RolloutResult:
    output: Path
    rows: int
    prompts: int
    prompts_dropped: int
    prompts_truncated: int
    truncated: int  # completions cut at max_new_tokens
    seconds: float


def _rollout_section(config: MopdConfig) -> RolloutConfig:
    if config.rollout is None:
        raise ConfigError("the config has no `rollout` section; add one (see docs/on-policy.md) to sample")
    return config.rollout


def check_student(student: str, tokenizer_path: str) -> str:
    """The student's fingerprint, once its vocabulary is shown to be the store's.

    Raises:
        ConfigError: the student is not a local checkpoint, or its tokenizer's vocabulary differs.
    """
    if not Path(student, "config.json").is_file():
        raise ConfigError(
            f"student {student} is not a transformers checkpoint folder (no config.json); a megatron run's "
            "student is exported first with `mopd export-hf`"
        )
    if vocab_hash(student) != vocab_hash(tokenizer_path):
        raise ConfigError(
            f"student {student}'s tokenizer vocabulary differs from {tokenizer_path}, the tokenizer the "
            "store is built with; the teachers would score other tokens than the student sampled"
        )
    return checkpoint_fingerprint(student)


def _parts_folder(output: Path, settings: dict[str, Any], log: Log) -> Path:
    """`<output>.parts/`, holding only parts of this rollout (another rollout's are removed)."""
    folder = output.with_name(output.name + ".parts")
    record = folder / SETTINGS_FILE
    if folder.exists():
        try:
            found = json.loads(record.read_text())
        except (OSError, ValueError):
            found = None
        if found == settings:
            return folder
        log(f"rollout: {folder} holds parts of another rollout; removing them and starting afresh")
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    write_replace(record, json.dumps(settings, indent=1, sort_keys=True).encode())
    return folder


@dataclass(frozen=True)
class RolloutPlan:
    """Everything a rollout samples from and records, resolved and checked before any sampling."""

    rollout: RolloutConfig
    student: str
    output: Path
    tokenizer: Any
    prompts: PromptSet
    stop_ids: frozenset[int]
    round_index: int
    provenance: dict[str, Any]  # the columns every row of this rollout shares

    @property
    def settings(self) -> dict[str, Any]:
        """What a resumed rollout must find unchanged in its parts folder."""
        return {
            **self.provenance,
            "prompts": self.prompts.fingerprint,
            "samples_per_prompt": self.rollout.samples_per_prompt,
            "prompts_per_part": self.rollout.prompts_per_part,
            "stop_ids": sorted(self.stop_ids),
        }

    @property
    def schema(self) -> pa.Schema:
        return row_schema(self.prompts.format, self.prompts.route_field, self.prompts.teachers_field)

    @property
    def batches(self) -> list[list[Prompt]]:
        size = self.rollout.prompts_per_part
        return [self.prompts.prompts[k : k + size] for k in range(0, len(self.prompts.prompts), size)]

    def rows(self, batch: list[Prompt], completions: list[list[Completion]], seeds: list[int]) -> list[dict]:
        return [
            sample_row(
                prompt,
                completion,
                fmt=self.prompts.format,
                tokenizer=self.tokenizer,
                turn_end=self.prompts.turn_end,
                route_field=self.prompts.route_field,
                teachers_field=self.prompts.teachers_field,
                provenance={
                    **self.provenance,
                    "prompt_index": prompt.index,
                    "sample_index": j,
                    "sample_seed": seed,
                },
            )
            for prompt, seed, samples in zip(batch, seeds, completions, strict=True)
            for j, completion in enumerate(samples)
        ]


def plan_rollout(
    config: MopdConfig,
    *,
    student: str | None,
    output: str | Path | None,
    prompts_path: str | None,
    round_index: int,
) -> RolloutPlan:
    """Resolves the student, output and prompts of a rollout and checks them.

    Raises:
        ConfigError: no rollout section, bad prompts, a student of another vocabulary, `output` exists.
    """
    rollout = _rollout_section(config)
    if student is None:
        if config.train is None:
            raise ConfigError("no student: pass --student or set train.student")
        student = config.train.student
    output = Path(output or rollout.output)
    check_output_suffix(output)
    if output.exists():
        raise ConfigError(f"rollout output {output} already exists; remove it or choose another --output")
    tokenizer_path = tokenizer_checkpoint(config.teachers, config.tokenizer)
    fingerprint = check_student(student, tokenizer_path)
    tokenizer = load_tokenizer(tokenizer_path)
    prompts = read_prompts(config, rollout, tokenizer, path=prompts_path or rollout.prompts)
    turn_end = prompts.turn_end
    return RolloutPlan(
        rollout=rollout,
        student=student,
        output=output,
        tokenizer=tokenizer,
        prompts=prompts,
        stop_ids=stop_token_ids(student, tokenizer, chat_end=turn_end[0] if turn_end else None),
        round_index=round_index,
        provenance={
            "round": round_index,
            "student": str(student),
            "student_fingerprint": fingerprint,
            "sampling_backend": rollout.backend,
            "sampling_temperature": rollout.temperature,
            "sampling_top_p": rollout.top_p,
            "sampling_max_new_tokens": rollout.max_new_tokens,
            "sampling_seed": rollout.seed,
        },
    )


def sample_parts(plan: RolloutPlan, parts: Path, *, max_model_len: int, log: Log) -> list[Path]:
    """Samples every part not yet written; returns all parts in order."""
    batches = plan.batches
    names = [parts / f"part-{k:06d}.parquet" for k in range(len(batches))]
    reused = sum(name.exists() for name in names)
    if reused:
        log(f"rollout: resuming; {reused} of {len(names)} parts are already written")
    start = time.perf_counter()
    sampler: Sampler | None = None
    try:
        for k, (batch, name) in enumerate(zip(batches, names, strict=True)):
            if name.exists():
                continue
            if sampler is None:
                sampler = load_sampler(
                    plan.student,
                    plan.rollout,
                    stop_ids=plan.stop_ids,
                    pad_id=min(plan.stop_ids),
                    max_model_len=max_model_len,
                )
            seeds = [sample_seed(plan.rollout.seed, plan.round_index, p.index) for p in batch]
            rows = plan.rows(batch, sampler.sample([p.ids for p in batch], seeds), seeds)
            write_part(name, rows, plan.schema)
            elapsed = time.perf_counter() - start
            log(f"rollout: part {k + 1}/{len(names)}: {len(rows)} samples ({elapsed:.0f} s)")
    finally:
        if sampler is not None:
            sampler.close()
    return names


def run_rollout(
    config: MopdConfig,
    *,
    student: str | None = None,
    output: str | Path | None = None,
    prompts_path: str | None = None,
    round_index: int = 0,
    log: Log = print,
) -> RolloutResult:
    """Samples `samples_per_prompt` completions of every prompt from `student` (default: train.student)
    and writes them to `output` (default: rollout.output); see `plan_rollout` for what is refused."""
    plan = plan_rollout(
        config, student=student, output=output, prompts_path=prompts_path, round_index=round_index
    )
    r, prompts = plan.rollout, plan.prompts
    log(
        f"rollout: {len(prompts.prompts):,} prompts × {r.samples_per_prompt} samples from {plan.student} "
        f"({r.backend}, temperature {r.temperature:g}, top_p {r.top_p:g}, seed {r.seed})"
    )
    if prompts.num_dropped or prompts.num_truncated:
        log(
            f"rollout: data.overlong {config.data.overlong}: {prompts.num_dropped} prompts left out, "
            f"{prompts.num_truncated} cut to data.max_length − max_new_tokens"
        )
    start = time.perf_counter()
    plan.output.parent.mkdir(parents=True, exist_ok=True)
    parts = _parts_folder(plan.output, plan.settings, log)
    names = sample_parts(plan, parts, max_model_len=config.data.max_length, log=log)
    truncated = 0

    def tables() -> Iterator[pa.Table]:  # one part in memory at a time
        nonlocal truncated
        for name in names:
            table = read_part(name)
            truncated += sum(table.column("truncated").to_pylist())
            yield table

    rows = write_dataset(plan.output, tables(), plan.schema)
    shutil.rmtree(parts)
    log(f"rollout: wrote {rows:,} rows to {plan.output} ({truncated} cut at max_new_tokens)")
    return RolloutResult(
        output=plan.output,
        rows=rows,
        prompts=len(prompts.prompts),
        prompts_dropped=prompts.num_dropped,
        prompts_truncated=prompts.num_truncated,
        truncated=truncated,
        seconds=time.perf_counter() - start,
    )

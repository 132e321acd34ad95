"""The teacher set of a precompute run: indices, fingerprints, the store's vocabulary and the teachers
of other tokenizers (DESIGN §13)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mopd.base.errors import ConfigError
from mopd.base.jsonio import parse_json
from mopd.store.format.fingerprint import checkpoint_fingerprint, tokenizer_vocab, vocab_hash
from mopd.store.format.manifest import TokenizerInfo
from mopd.store.format.teachers import TeacherSlot, alias_to_index, assign_teacher_indices
from mopd.tokens.pieces import token_table, tokenizer_fingerprint
from mopd.tokens.projection import Projection, first_token_projection


@dataclass(frozen=True)
class TeacherSet:
    slots: list[TeacherSlot]
    fingerprints: dict[int, str]
    tokenizer_path: str
    vocab_hash: str
    vocab_size: int
    contexts: dict[int, int]  # teacher index → its context (max_position_embeddings), where it says
    # Teachers whose tokenizer is not the store's: index → the checkpoint whose tokenizer they read.
    cross: dict[int, str] = field(default_factory=dict)

    @property
    def alias_index(self) -> dict[str, int]:
        return alias_to_index(self.slots)


def tokenizer_checkpoint(
    teachers: Mapping[str, str], tokenizer: str | None = None, student: str | None = None
) -> str:
    """The checkpoint whose tokenizer the store's rows are in: `tokenizer`; else the student's, where
    its vocabulary is not the first teacher's (the teachers of other tokenizers are aligned to it);
    else the first teacher's."""
    if tokenizer:
        return tokenizer
    first = assign_teacher_indices(teachers)[0].checkpoint
    student_has_one = student is not None and (Path(student) / "tokenizer.json").exists()
    if student_has_one and vocab_hash(str(student)) != vocab_hash(first):
        return str(student)
    return first


def resolve_teachers(
    teachers: Mapping[str, str], tokenizer: str | None = None, student: str | None = None
) -> TeacherSet:
    """Numbers the teachers (alias → checkpoint), fingerprints them, and sorts them into those that share
    the store's vocabulary (`tokenizer_checkpoint`) and those of other tokenizers (`TeacherSet.cross`).

    Raises:
        ConfigError: a checkpoint does not exist or is unreadable.
    """
    slots = assign_teacher_indices(teachers)
    for slot in slots:
        if not Path(slot.checkpoint).is_dir():
            raise ConfigError(
                f"teachers.{slot.aliases[0]}: checkpoint {slot.checkpoint} does not exist (mopd loads local "
                "checkpoints only; download it first)"
            )
    tokenizer_path = tokenizer_checkpoint(teachers, tokenizer, student)
    expected = vocab_hash(tokenizer_path)
    fingerprints, contexts, cross = {}, {}, {}
    for slot in slots:
        with _naming(slot):
            if vocab_hash(slot.checkpoint) != expected:
                cross[slot.index] = slot.checkpoint
            fingerprints[slot.index] = checkpoint_fingerprint(slot.checkpoint)
            if (context := context_length(slot.checkpoint)) is not None:
                contexts[slot.index] = context
    return TeacherSet(
        slots=slots,
        fingerprints=fingerprints,
        tokenizer_path=tokenizer_path,
        vocab_hash=expected,
        vocab_size=len(tokenizer_vocab(tokenizer_path)),
        contexts=contexts,
        cross=cross,
    )


@contextmanager
def _naming(slot: TeacherSlot) -> Iterator[None]:
    """A refusal of the teacher's checkpoint names the config key that chose it."""
    try:
        yield
    except ConfigError as err:
        if str(err).startswith("teachers."):
            raise
        raise ConfigError(f"teachers.{slot.aliases[0]}: {err}") from err


# Where model configs state how many positions the model was built for.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_length(checkpoint: str) -> int | None:
    """The positions a checkpoint's model was built for (its config.json), or None where it says none.

    Raises:
        ConfigError: config.json cannot be read.
    """
    path = Path(checkpoint) / "config.json"
    try:
        config = parse_json(path.read_bytes(), what=str(path), error=ConfigError)
    except OSError as err:
        raise ConfigError(f"{path} cannot be read ({err.strerror})") from err
    config = {**config.get("text_config", {}), **config} if isinstance(config, dict) else {}
    found = [config[key] for key in _CONTEXT_KEYS if isinstance(config.get(key), int) and config[key] > 0]
    return int(found[0]) if found else None


def load_tokenizer(path: str, *, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ConfigError(f"tokenizer {path} cannot be loaded ({err})") from err


def tokenizer_info(path: str, *, trust_remote_code: bool = False) -> TokenizerInfo:
    """A checkpoint's tokenizer as a manifest records it, its fingerprint included."""
    return TokenizerInfo(
        name=path,
        vocab_hash=vocab_hash(path),
        vocab_size=len(tokenizer_vocab(path)),
        fingerprint=tokenizer_fingerprint(load_tokenizer(path, trust_remote_code=trust_remote_code)),
    )


def teacher_projection(teachers: TeacherSet, teacher: int, trust_remote_code: bool = False) -> Projection:
    """A teacher of another tokenizer's projection onto the store's vocabulary (DESIGN §13)."""
    student = load_tokenizer(teachers.tokenizer_path, trust_remote_code=trust_remote_code)
    own = load_tokenizer(teachers.cross[teacher], trust_remote_code=trust_remote_code)
    projection = first_token_projection(token_table(own), student, token_table(student))
    projection.check(student_vocab=teachers.vocab_size, origin=f"of teacher {teacher}")
    return projection

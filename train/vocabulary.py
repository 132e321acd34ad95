"""The vocabulary the divergence runs over, and how tensor parallelism splits it (DESIGN §6, §7).

Models pad their output layers past the tokenizer (Qwen2.5-7B to 152,064 rows, Qwen2.5-1.5B to 151,936,
for one tokenizer of 151,665 tokens). Rows past the tokenizer belong to no token id, so the teacher's
distribution over tokens that exist is its softmax over the tokenizer's rows alone: the distillation
runs over the shared real vocabulary, `V = len(tokenizer)` as the store records it (or
`train.vocab_size`, for tokenizers whose added tokens sit past the model's rows), and every row at or
past V, of either side, is masked out of both softmaxes. Only a side with fewer than V rows is refused.
"""

from __future__ import annotations

from mopd.base.errors import ConfigError
from mopd.store.format.manifest import Manifest


def distilled_vocabulary(manifest: Manifest, *, student_rows: int, override: int | None = None) -> int:
    """V: the tokenizer's length (or `override`), checked against every output layer's rows.

    Raises:
        ConfigError: V exceeds the student's or a teacher's rows (naming both sizes), the override
            exceeds the tokenizer, or is set with teachers of another tokenizer.
    """
    cross = [f"{t.index} ({', '.join(t.aliases)})" for t in manifest.teachers if t.tokenizer is not None]
    if cross and override is not None:
        raise ConfigError(
            f"train.vocab_size: the store's teachers {', '.join(cross)} have another tokenizer, whose "
            f"projections cover all {manifest.tokenizer.vocab_size} tokens of {manifest.tokenizer.name}; "
            "leave train.vocab_size unset"
        )
    tokens = manifest.tokenizer.vocab_size
    if override is not None and override > tokens:
        raise ConfigError(
            f"train.vocab_size: {override} is more than the tokenizer's {tokens} tokens "
            f"({manifest.tokenizer.name}); it may only leave out added tokens past the models' rows"
        )
    vocab = override or tokens
    source = "train.vocab_size" if override else f"the tokenizer ({manifest.tokenizer.name})"
    if student_rows < vocab:
        raise ConfigError(
            f"train.student: its output layer has {student_rows} rows, fewer than the {vocab} tokens of "
            f"{source}; every token needs a row (set train.vocab_size if the tokenizer's added tokens "
            "are not the model's)"
        )
    for teacher in manifest.teachers:
        if teacher.tokenizer is not None:  # its rows are its own vocabulary's, projected onto this one
            continue
        if teacher.vocab_size < vocab:
            raise ConfigError(
                f"teacher {teacher.index} ({teacher.checkpoint}) has {teacher.vocab_size} output rows, "
                f"fewer than the {vocab} tokens of {source}; set train.vocab_size to at most "
                f"{teacher.vocab_size} if its missing rows are added tokens no row was ever trained for"
            )
    return vocab

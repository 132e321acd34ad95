"""Manifest records written before teachers of other tokenizers existed stay byte for byte what they
were: the fields that feature added are left out of the JSON at their defaults (`_Record`'s
OMITTED_AT_DEFAULT), so a store of teachers of one tokenizer hashes as an earlier mopd's did."""

from __future__ import annotations

from mopd.store.format.manifest import (
    AlignmentCounts,
    PartRecord,
    ShardArtifact,
    TeacherInfo,
    TokenizerInfo,
)


def test_fields_of_the_cross_tokenizer_feature_are_absent_at_their_defaults() -> None:
    tokenizer = TokenizerInfo(name="t", vocab_hash="h", vocab_size=3)
    teacher = TeacherInfo(index=0, checkpoint="c", aliases=["a"], fingerprint="f", backend="hf")
    part = PartRecord(task_id="x", identity="i", num_rows=1, num_tokens=2, bytes=3, hash="h", files={})
    shard = ShardArtifact(
        task_id="x", path="p", rows=1, tokens=2, bytes=3, hash="h", part_sha256="s", teacher=0, shard=0
    )
    assert tokenizer.model_dump(mode="json") == {"name": "t", "vocab_hash": "h", "vocab_size": 3}
    assert "tokenizer" not in teacher.model_dump(mode="json")
    for field in ("aligned_tokens", "alignment"):
        assert field not in part.model_dump(mode="json") and field not in shard.model_dump(mode="json")
    # ... and present where they are set, so that a store with such teachers records them.
    own = TokenizerInfo(name="o", vocab_hash="g", vocab_size=5, fingerprint="p")
    assert own.model_dump(mode="json")["fingerprint"] == "p"
    bound = TeacherInfo(**{**teacher.model_dump(), "tokenizer": own})
    assert bound.model_dump(mode="json")["tokenizer"]["fingerprint"] == "p"
    assert (
        PartRecord(**{**part.model_dump(), "aligned_tokens": 7}).model_dump(mode="json")["aligned_tokens"]
        == 7
    )
    counts = AlignmentCounts(trained=4, aligned=3, reached=4)
    assert ShardArtifact(**{**shard.model_dump(), "alignment": counts}).model_dump(mode="json")[
        "alignment"
    ] == {"trained": 4, "aligned": 3, "reached": 4}

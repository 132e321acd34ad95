from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from mopd.store.format.fingerprint import checkpoint_fingerprint, lm_head_tensor_name, vocab_hash
from tests.store.synthetic import make_checkpoint


def test_fingerprint_follows_content_not_path(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "a", hidden_size=16, seed=0)
    fingerprint = checkpoint_fingerprint(ckpt)
    moved = Path(shutil.copytree(ckpt, tmp_path / "elsewhere" / "b"))
    assert checkpoint_fingerprint(moved) == fingerprint
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**config, "transformers_version": "9.9"}))
    assert checkpoint_fingerprint(moved) == fingerprint  # how it was saved does not matter
    (moved / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert checkpoint_fingerprint(moved) != fingerprint


def test_fingerprint_changes_with_head_bytes(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "a", hidden_size=16, seed=0)
    before = checkpoint_fingerprint(ckpt)
    weights = load_file(ckpt / "model.safetensors")
    weights["lm_head.weight"][3, 2] *= -1
    save_file(weights, ckpt / "model.safetensors")
    assert checkpoint_fingerprint(ckpt) != before


def test_tied_head_uses_embedding(tmp_path: Path) -> None:
    tied = make_checkpoint(tmp_path / "t", hidden_size=16, seed=0, tied=True)
    assert lm_head_tensor_name(tied) == "model.embed_tokens.weight"


def test_vocab_hash_compares_vocabularies(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a", hidden_size=16, seed=0)
    b = make_checkpoint(tmp_path / "b", hidden_size=32, seed=1)
    c = make_checkpoint(tmp_path / "c", hidden_size=16, seed=0, vocab_size=301)
    assert vocab_hash(a) == vocab_hash(b) != vocab_hash(c)

"""Content fingerprints of teacher checkpoints (DESIGN §3).

fingerprint = sha256 over (canonical config.json, tokenizer vocabulary, LM-head tensor bytes). It is read
from the checkpoint's files — the LM head straight out of its safetensors file, never through a model
load — so it is cheap, independent of the dtype a backend computes in, and the same whichever stage
computes it. A moved checkpoint keeps its fingerprint; a changed head or config at the same path does not.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from mopd.store.errors import ConfigError

# Keys that describe how a config was saved, not what the model computes.
_VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})
_UNTIED_HEAD_NAMES = ("lm_head.weight", "output.weight", "embed_out.weight", "output_layer.weight")
_EMBEDDING_NAMES = ("model.embed_tokens.weight", "transformer.wte.weight", "embed_tokens.weight")
_HASH_BLOCK = 1 << 24


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise ConfigError(f"checkpoint file {path} not found") from err
    except ValueError as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from err


def tokenizer_vocab(checkpoint: str | Path) -> dict[str, int]:
    """token → id of the checkpoint's tokenizer.json, added tokens included."""
    data = _read_json(Path(checkpoint) / "tokenizer.json")
    model_vocab = data.get("model", {}).get("vocab", {})
    if isinstance(model_vocab, list):  # Unigram: [[piece, score], ...] in id order
        vocab = {piece: i for i, (piece, _score) in enumerate(model_vocab)}
    else:
        vocab = {str(tok): int(i) for tok, i in model_vocab.items()}
    for added in data.get("added_tokens", []):
        vocab[str(added["content"])] = int(added["id"])
    return vocab


def vocab_hash(checkpoint: str | Path) -> str:
    """sha256 of the sorted token → id table; equal hashes mean one shared vocabulary."""
    return hashlib.sha256(_canonical(sorted(tokenizer_vocab(checkpoint).items()))).hexdigest()


def _safetensors_files(folder: Path) -> dict[str, Path]:
    """tensor name → the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index)["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise ConfigError(
            f"{folder} has no model.safetensors or model.safetensors.index.json; "
            "mopd reads checkpoints in safetensors format (save them with save_pretrained)"
        )
    return {name: single for name in _safetensors_header(single)[0] if name != "__metadata__"}


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def lm_head_tensor_name(checkpoint: str | Path) -> str:
    """Name of the tensor that serves as the LM head (the embedding when the head is tied)."""
    folder = Path(checkpoint)
    names = _safetensors_files(folder)
    tied = bool(_read_json(folder / "config.json").get("tie_word_embeddings", False))
    candidates = (
        (*_EMBEDDING_NAMES, *_UNTIED_HEAD_NAMES) if tied else (*_UNTIED_HEAD_NAMES, *_EMBEDDING_NAMES)
    )
    for name in candidates:
        if name in names:
            return name
    raise ConfigError(f"{folder}: no LM-head tensor found (looked for {', '.join(candidates)})")


def _hash_tensor_bytes(digest: Any, path: Path, name: str) -> None:
    header, data_start = _safetensors_header(path)
    entry = header[name]
    start, stop = entry["data_offsets"]
    digest.update(_canonical({"name": name, "dtype": entry["dtype"], "shape": entry["shape"]}))
    with path.open("rb") as f:
        f.seek(data_start + start)
        remaining = stop - start
        while remaining:
            block = f.read(min(_HASH_BLOCK, remaining))
            if not block:
                raise ConfigError(f"{path}: tensor {name} is truncated")
            digest.update(block)
            remaining -= len(block)


def checkpoint_fingerprint(checkpoint: str | Path) -> str:
    """sha256 of the checkpoint's config, tokenizer vocabulary and LM-head bytes.

    Raises:
        ConfigError: a file is missing or unreadable (the message names it).
    """
    folder = Path(checkpoint)
    if not folder.is_dir():
        raise ConfigError(f"checkpoint {folder} is not a folder")
    config = {k: v for k, v in _read_json(folder / "config.json").items() if k not in _VOLATILE_CONFIG_KEYS}
    digest = hashlib.sha256()
    digest.update(b"config\0" + _canonical(config))
    digest.update(b"vocab\0" + vocab_hash(folder).encode())
    name = lm_head_tensor_name(folder)
    digest.update(b"lm_head\0")
    _hash_tensor_bytes(digest, _safetensors_files(folder)[name], name)
    return digest.hexdigest()

"""Content fingerprints of teacher checkpoints (DESIGN §3).

A teacher's fingerprint is a sha256 over every byte that decides its outputs: each weight file
(`*.safetensors`, with the shard index), the model config (canonical JSON, without the keys that only
say how it was saved), the tokenizer files, any model code (`*.py`, which `trust_remote_code` runs) and
the logit transform the config declares. Files are named by their path inside the checkpoint, so a
byte-identical copy at another path is the same teacher, and a changed tensor anywhere is a different
one. It is read from the files, never through a model load, so it does not depend on the dtype a backend
computes in. Each file is hashed once per process (`_file_sha256` caches by path, size and mtime), on
parallel threads: sha256 releases the GIL on large buffers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mopd.base.errors import ConfigError
from mopd.store.format.transform import LogitTransform

# Keys that describe how a config was saved, not what the model computes.
_VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})
_UNTIED_HEAD_NAMES = ("lm_head.weight", "output.weight", "embed_out.weight", "output_layer.weight")
_EMBEDDING_NAMES = ("model.embed_tokens.weight", "transformer.wte.weight", "embed_tokens.weight")
_HASH_BLOCK = 1 << 24
# Files that decide what a tokenizer produces (whichever a checkpoint has).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)


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


@functools.lru_cache(maxsize=4096)
def _cached_sha256(path: str, _size: int, _mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _file_sha256(path: Path) -> str:
    """sha256 of a file, computed once per process while its size and mtime stay the same."""
    stat = path.stat()
    return _cached_sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def _model_files(folder: Path) -> list[str]:
    """Relative paths of the files that decide the outputs, sorted."""
    names = {rel for rel in TOKENIZER_FILES if (folder / rel).is_file()}
    for path in folder.rglob("*"):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and not rel.startswith(".") and path.suffix in (".safetensors", ".py"):
            names.add(rel)
    return sorted(names)


def checkpoint_fingerprint(checkpoint: str | Path, *, threads: int | None = None) -> str:
    """sha256 over the checkpoint's weights, config, tokenizer files, code and logit transform.

    Raises:
        ConfigError: the folder, its config or its safetensors weights are missing or unreadable.
    """
    folder = Path(checkpoint)
    if not folder.is_dir():
        raise ConfigError(f"checkpoint {folder} is not a folder")
    config = {k: v for k, v in _read_json(folder / "config.json").items() if k not in _VOLATILE_CONFIG_KEYS}
    _safetensors_files(folder)  # refuses a checkpoint without safetensors weights
    files = _model_files(folder)
    workers = threads or min(8, os.cpu_count() or 1)
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            hashes = list(pool.map(lambda rel: _file_sha256(folder / rel), files))
    except OSError as err:
        raise ConfigError(f"cannot read teacher file {err.filename}: {err.strerror}") from err
    transform = LogitTransform.from_model_config(SimpleNamespace(**config))
    digest = hashlib.sha256(b"mopd-teacher-fingerprint/2\0")
    digest.update(b"config\0" + _canonical(config))
    digest.update(b"transform\0" + _canonical([transform.logit_scale, transform.final_logit_softcap]))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        digest.update(b"index\0" + _canonical(_read_json(index).get("weight_map", {})))
    for rel, file_hash in zip(files, hashes, strict=True):
        digest.update(b"file\0" + _canonical([rel, file_hash]))
    return digest.hexdigest()

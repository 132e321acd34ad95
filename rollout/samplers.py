"""The student's two samplers: transformers `generate` and vLLM's offline engine.

Both continue token ids (never text), sample with the temperature and top-p of `rollout` and nothing
else (no top-k, no repetition penalty, none of the checkpoint's own generation defaults), stop at the
first of the stop ids, and draw each prompt's samples from a seed of its own, so a prompt's samples do
not depend on which other prompts share its batch: a resumed rollout writes what an unbroken one would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from mopd.base.devices import check_device, resolve_device
from mopd.base.errors import ConfigError
from mopd.config.rollout import RolloutConfig
from mopd.precompute.output_layer import resolve_dtype

Finish = Literal["stop", "length"]


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # the sampled ids, the stop id included when there is one
    finish: Finish  # "stop": ended at a stop id; "length": cut at max_new_tokens


class Sampler(Protocol):
    name: str

    def sample(self, prompts: Sequence[list[int]], seeds: Sequence[int]) -> list[list[Completion]]:
        """`samples_per_prompt` completions of each prompt, prompt k drawn from `seeds[k]`."""
        ...

    def close(self) -> None: ...


def finish_at_stop(ids: Sequence[int], stop_ids: frozenset[int], max_new_tokens: int) -> Completion:
    """A sampled sequence cut after its first stop id (what follows is padding)."""
    for k, token in enumerate(ids):
        if token in stop_ids:
            return Completion([int(t) for t in ids[: k + 1]], "stop")
    if len(ids) < max_new_tokens:
        raise RuntimeError(f"a sample of {len(ids)} tokens neither stopped nor reached {max_new_tokens}")
    return Completion([int(t) for t in ids], "length")


class HFSampler:
    """transformers `generate`, one prompt at a time with its `samples_per_prompt` sequences."""

    name = "hf"

    def __init__(
        self, student: str, rollout: RolloutConfig, *, stop_ids: frozenset[int], pad_id: int
    ) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        check_device(rollout.device, key="rollout.device")
        self.device = resolve_device(rollout.device)
        dtype = resolve_dtype(rollout.dtype, self.device)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(student, dtype=dtype).to(self.device).eval()
        except (OSError, ValueError) as err:
            raise ConfigError(f"student {student} cannot be loaded by transformers ({err})") from err
        # generate() fills every setting left unset from the checkpoint's own generation config (a
        # repetition penalty, a top-k, a min-p, ...): replace it by the neutral one, so that only the
        # settings below shape the samples.
        self.model.generation_config = GenerationConfig()
        self.rollout = rollout
        self.stop_ids = stop_ids
        self.generation = GenerationConfig(
            do_sample=True,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=0,
            max_new_tokens=rollout.max_new_tokens,
            num_return_sequences=rollout.samples_per_prompt,
            eos_token_id=sorted(stop_ids),
            pad_token_id=pad_id,
        )

    @torch.no_grad()
    def sample(self, prompts: Sequence[list[int]], seeds: Sequence[int]) -> list[list[Completion]]:
        out = []
        for ids, seed in zip(prompts, seeds, strict=True):
            torch.manual_seed(seed)
            prompt = torch.tensor([ids], device=self.device)
            generated = self.model.generate(
                input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=self.generation
            )
            new = generated[:, len(ids) :].tolist()
            out.append([finish_at_stop(row, self.stop_ids, self.rollout.max_new_tokens) for row in new])
        return out

    def close(self) -> None:
        del self.model


class VLLMSampler:
    """vLLM's offline engine over all prompts at once, a per-request seed for each prompt."""

    name = "vllm"

    def __init__(
        self, student: str, rollout: RolloutConfig, *, stop_ids: frozenset[int], max_model_len: int
    ) -> None:
        from mopd.precompute.vllm_backend import import_vllm, kv_cache_bytes

        vllm = import_vllm("rollout.backend vllm")
        check_device(rollout.device, key="rollout.device")
        device = resolve_device(rollout.device)
        dtype = resolve_dtype(rollout.dtype, device)
        # On a GPU vLLM takes its share of the device; on the CPU that share is of the machine's memory,
        # so reserve what one part's sequences can hold at their longest, and no more.
        sequences = rollout.prompts_per_part * rollout.samples_per_prompt
        cache = kv_cache_bytes(
            student, dtype=dtype, tokens=sequences * max_model_len, trust_remote_code=False
        )
        self.rollout = rollout
        self.stop_ids = stop_ids
        self._vllm = vllm
        try:
            self._llm = vllm.LLM(
                model=student,
                runner="generate",
                dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                max_model_len=max_model_len,
                enforce_eager=device.type == "cpu",
                kv_cache_memory_bytes=cache if device.type == "cpu" else None,
                generation_config="vllm",  # vLLM's neutral defaults, not the checkpoint's
                seed=rollout.seed,
            )
        except (ValueError, RuntimeError, OSError) as err:
            raise ConfigError(f"student {student}: vLLM cannot load it for generation ({err})") from err

    def sample(self, prompts: Sequence[list[int]], seeds: Sequence[int]) -> list[list[Completion]]:
        vllm, r = self._vllm, self.rollout
        params = [
            vllm.SamplingParams(
                n=r.samples_per_prompt,
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=0,
                max_tokens=r.max_new_tokens,
                seed=seed,
                stop_token_ids=sorted(self.stop_ids),
                detokenize=False,
            )
            for seed in seeds
        ]
        requests = [vllm.inputs.TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts]
        outputs = self._llm.generate(requests, params, use_tqdm=False)
        return [
            [finish_at_stop(list(c.token_ids), self.stop_ids, r.max_new_tokens) for c in out.outputs]
            for out in outputs
        ]

    def close(self) -> None:
        from mopd.precompute.vllm_backend import shutdown

        shutdown(self._llm)
        del self._llm


def load_sampler(
    student: str, rollout: RolloutConfig, *, stop_ids: frozenset[int], pad_id: int, max_model_len: int
) -> Sampler:
    if rollout.backend == "vllm":
        return VLLMSampler(student, rollout, stop_ids=stop_ids, max_model_len=max_model_len)
    return HFSampler(student, rollout, stop_ids=stop_ids, pad_id=pad_id)


def stop_token_ids(student: str, tokenizer: Any, *, chat_end: int | None) -> frozenset[int]:
    """The ids a completion ends at: the tokenizer's EOS, the checkpoint's generation EOS ids, and for
    chat prompts the token that closes the assistant turn in the chat template."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        eos = GenerationConfig.from_pretrained(student).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    ids.update([int(eos)] if isinstance(eos, int) else [int(e) for e in eos or []])
    if chat_end is not None:
        ids.add(chat_end)
    if not ids:
        raise ConfigError(f"student {student}: its tokenizer has no EOS token, so no completion could end")
    return frozenset(ids)

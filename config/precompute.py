"""What `mopd precompute` reads: the dataset, how its rows route to teachers, and how teachers run."""

from __future__ import annotations

from typing import Annotated, Literal, TypeAlias

from pydantic import Field

from mopd.base.errors import ConfigError
from mopd.base.section import Device, NonEmpty, Section
from mopd.config.parallel import ParallelConfig

# One alias, or a list of them: a row routed to a list is scored by each of those teachers, each
# checkpoint once (DESIGN §14; `train.ensemble` says how their distributions combine).
Aliases: TypeAlias = NonEmpty | Annotated[list[NonEmpty], Field(min_length=1)]


def alias_list(aliases: str | list[str]) -> list[str]:
    """The aliases of a routing value, in the order given, each once."""
    return list(dict.fromkeys([aliases] if isinstance(aliases, str) else aliases))


class RoutingConfig(Section):
    """How a row's metadata column picks its teacher alias (or aliases)."""

    field: str = "agent"
    # agent -> alias or list of aliases; empty means every alias routes the agent of the same name.
    teacher_by_agent: dict[str, Aliases] = Field(default_factory=dict)
    default_teacher: Aliases | None = None
    # A column holding a row's own list of aliases; where a row has it (not null), it is the row's
    # teachers whatever its agent.
    teachers_field: NonEmpty | None = None


class DataConfig(Section):
    path: NonEmpty
    max_length: int = Field(2048, gt=0)
    # Rows longer than max_length: cut to max_length ("truncate") or left out ("drop").
    overlong: Literal["truncate", "drop"] = "truncate"
    # Processes that tokenise the dataset (once per store: later jobs read the ingest cache). Default:
    # the machine's cores, at most 8; datasets under 10k rows per process tokenise in one.
    num_proc: int | None = Field(None, ge=1)


class PrecomputeConfig(Section):
    backend: Literal["hf", "vllm", "megatron"] = "hf"
    # Padded tokens per forward batch (rows × longest row).
    batch_tokens: int = Field(16384, gt=0)
    device: Device = "auto"
    # Teacher compute dtype; auto = bfloat16 on GPU, float32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Rows of one teacher per task (the unit of resumption and of splitting across jobs).
    rows_per_task: int = Field(1024, gt=0)
    trust_remote_code: bool = False
    # Teacher tensor/pipeline parallelism: the vllm backend runs one engine over tp × pp devices per job;
    # the megatron backend runs under torchrun, each tp × pp group of ranks one job.
    parallel: ParallelConfig = ParallelConfig()

    def with_backend(self, backend: str | None) -> PrecomputeConfig:
        """These settings for the backend that runs: `backend` (the command line's `--backend`), else
        the config's own. The backend and the teacher parallelism are checked together here, not when the
        config loads: `--backend megatron` may be what makes a config's `parallel` valid.

        Raises:
            ConfigError: tensor or pipeline parallelism for the hf backend, or sequence parallelism for
                a backend other than megatron.
        """
        settings = self if backend is None else self.model_copy(update={"backend": backend})
        tp, pp = settings.parallel.tp, settings.parallel.pp
        if settings.backend == "hf" and tp * pp > 1:
            raise ConfigError(
                f"precompute.parallel tp={tp} × pp={pp} needs the vllm or megatron backend; the hf backend "
                "runs each teacher whole on one device: set tp = pp = 1, or use --backend vllm"
            )
        if settings.backend == "vllm" and settings.parallel.sequence_parallel:
            raise ConfigError(
                "precompute.parallel.sequence_parallel is the megatron backend's; vLLM splits the sequence "
                "its own way: leave it false with --backend vllm"
            )
        return settings

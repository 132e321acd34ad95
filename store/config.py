"""The one YAML config shared by `mopd precompute` and `mopd train` (DESIGN §9).

Each component owns a small frozen model; `MopdConfig` only composes them. Unknown keys are errors, and
every error names the dotted key the user wrote. Relative paths are resolved against the folder that
holds the config file, so a config means the same thing from any working directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mopd.store.errors import ConfigError
from mopd.store.jsonio import check_unicode, decode_text, describe_location


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RoutingConfig(_Section):
    """How a row's metadata column picks its teacher alias."""

    field: str = "agent"
    # agent -> alias; empty means every alias routes the agent of the same name.
    teacher_by_agent: dict[str, str] = Field(default_factory=dict)
    default_teacher: str | None = None


class DataConfig(_Section):
    path: str
    max_length: int = Field(2048, gt=0)
    # Rows longer than max_length: cut to max_length ("truncate") or left out ("drop").
    overlong: Literal["truncate", "drop"] = "truncate"
    # Processes that tokenise the dataset (once per store: later jobs read the ingest cache). Default:
    # the machine's cores, at most 8; datasets under 10k rows per process tokenise in one.
    num_proc: int | None = Field(None, ge=1)


class StoreConfig(_Section):
    path: str = "out/teachers.zarr"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    codec: Literal["shuffle-zstd1", "none"] = "shuffle-zstd1"


class ParallelConfig(_Section):
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    # Split the sequence over the tensor-parallel ranks outside attention and MLP (megatron backend).
    sequence_parallel: bool = False

    @model_validator(mode="after")
    def _sequence_parallel_needs_tp(self) -> ParallelConfig:
        if self.sequence_parallel and self.tp < 2:
            raise ValueError(
                "sequence_parallel splits the sequence over the tensor-parallel ranks: it needs tp ≥ 2"
            )
        return self


class PrecomputeConfig(_Section):
    backend: Literal["hf", "vllm", "megatron"] = "hf"
    # Padded tokens per forward batch (rows × longest row).
    batch_tokens: int = Field(16384, gt=0)
    device: str = "auto"
    # Teacher compute dtype; auto = bfloat16 on GPU, float32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Rows of one teacher per task (the unit of resumption and of splitting across jobs).
    rows_per_task: int = Field(1024, gt=0)
    trust_remote_code: bool = False
    # Teacher tensor/pipeline parallelism (megatron backend, under torchrun).
    parallel: ParallelConfig = ParallelConfig()


class DivergenceConfig(_Section):
    kind: Literal["reverse_kl", "forward_kl", "jsd", "cross_entropy", "entropy", "tvd"] = "reverse_kl"
    beta: float = Field(0.5, ge=0.0, le=1.0)
    temperature: float = Field(1.0, gt=0.0)
    # Tokens per kernel chunk; "auto": the measured default of the device (train/divergence.py).
    chunk_size: Annotated[int, Field(gt=0)] | Literal["auto"] = "auto"
    ce_weight: float = Field(0.0, ge=0.0)
    # The chunk chain compiled with torch.compile: "auto" on CUDA only; a failure to compile falls
    # back to eager with one log line.
    compile: Literal["auto", "on", "off"] = "auto"
    # "token": mean over the step's trained tokens; "sequence": mean per row, then over the step's rows.
    level: Literal["token", "sequence"] = "token"

    @model_validator(mode="after")
    def _jsd_is_not_degenerate(self) -> DivergenceConfig:
        # mopd's JSD(β) mixes m = β·p_t + (1−β)·p_s: at β = 0 or 1, m is one of the two distributions and
        # the divergence is 0 with zero gradient. Other tools' β = 1 means reverse KL; say so, never
        # train on a silent zero.
        if self.kind == "jsd" and self.beta in (0.0, 1.0):
            instead = "reverse_kl" if self.beta == 1.0 else "forward_kl"
            raise ValueError(
                f"kind jsd with beta {self.beta} is identically 0 (nothing would train); for what other "
                f"tools call JSD at beta {self.beta:g}, use kind: {instead}"
            )
        return self


class OptimConfig(_Section):
    lr: float = Field(1.0e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(10, ge=0)
    grad_clip: float = Field(1.0, gt=0.0)


class BatchConfig(_Section):
    micro_batch_tokens: int = Field(8192, gt=0)
    global_batch_tokens: int = Field(65536, gt=0)


class EvalConfig(_Section):
    # Rows held out of training (a seeded choice) and evaluated every `every` steps (0: start and end).
    rows: int = Field(0, ge=0)
    every: int = Field(0, ge=0)


class CheckpointConfig(_Section):
    every: int = Field(100, gt=0)
    keep: int = Field(3, ge=1)


class InitFromConfig(_Section):
    """A new run that starts from a training checkpoint's student (and optionally its optimizer state)."""

    checkpoint: str
    optimizer: bool = False


class TrainConfig(_Section):
    student: str
    # Start this (new) run from another run's checkpoint: its weights, and with optimizer: true its
    # AdamW moments; the data order, schedule and step count start afresh. Never a resume.
    init_from: InitFromConfig | None = None
    backend: Literal["hf", "megatron"] = "hf"
    parallel: ParallelConfig = ParallelConfig()
    divergence: DivergenceConfig = DivergenceConfig()
    teacher_weights: dict[str, float] = Field(default_factory=dict)
    lm_head_lifecycle: Literal["none", "offload", "evict"] = "offload"
    optim: OptimConfig = OptimConfig()
    batch: BatchConfig = BatchConfig()
    steps: int = Field(1000, gt=0)
    seed: int = 0
    device: str = "auto"
    # Student parameter dtype (AdamW state follows it).
    dtype: Literal["float32", "bfloat16"] = "float32"
    # The vocabulary distilled over; default the tokenizer's length as the store records it (see
    # train/vocabulary.py). Set it only when the tokenizer's added tokens sit past the models' rows.
    vocab_size: int | None = Field(None, gt=0)
    eval: EvalConfig = EvalConfig()
    # Steps the loader reads ahead of training, in a background thread (their rows stay in memory).
    prefetch: int = Field(2, ge=1)
    output_dir: str = "out/run"
    checkpoint: CheckpointConfig = CheckpointConfig()

    @model_validator(mode="before")
    @classmethod
    def _init_from_shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("init_from"), str):
            return {**data, "init_from": {"checkpoint": data["init_from"]}}
        return data


class MopdConfig(_Section):
    tokenizer: str | None = None
    teachers: dict[str, str] = Field(min_length=1)
    routing: RoutingConfig = RoutingConfig()
    data: DataConfig
    store: StoreConfig = StoreConfig()
    precompute: PrecomputeConfig = PrecomputeConfig()
    train: TrainConfig | None = None

    @model_validator(mode="after")
    def _aliases_exist(self) -> MopdConfig:
        aliases = set(self.teachers)
        for agent, alias in self.routing.teacher_by_agent.items():
            if alias not in aliases:
                raise ValueError(
                    f"routing.teacher_by_agent.{agent}: alias {alias!r} is not in teachers "
                    f"({', '.join(sorted(aliases))})"
                )
        default = self.routing.default_teacher
        if default is not None and default not in aliases:
            raise ValueError(f"routing.default_teacher: alias {default!r} is not in teachers")
        if self.train is not None:
            weights = self.train.teacher_weights
            for alias, weight in weights.items():
                if alias not in aliases:
                    raise ValueError(f"train.teacher_weights.{alias}: not an alias in teachers")
                if weight < 0:
                    raise ValueError(f"train.teacher_weights.{alias}: {weight} is negative; weights are ≥ 0")
            if (
                all(weights.get(alias, 1.0) == 0 for alias in aliases)
                and self.train.divergence.ce_weight == 0
            ):
                raise ValueError(
                    "train.teacher_weights: every teacher's weight is 0 (and ce_weight is 0), so the loss is "
                    "0 and nothing would train; give at least one teacher a positive weight"
                )
        return self

    def agent_to_alias(self) -> dict[str, str]:
        """The routing table: explicit `teacher_by_agent`, else each alias routes its own name."""
        return dict(self.routing.teacher_by_agent) or {alias: alias for alias in self.teachers}


MAX_CONFIG_BYTES = 1 << 20


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML silently keeps the last one) and aliases
    (`*name`: a few nested ones expand to billions of nodes, and a mopd config never needs one)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.events.AliasEvent):
            mark = self.peek_event().start_mark
            raise ConfigError(
                f"YAML alias at line {mark.line + 1}: aliases (*name) are not allowed in a config"
            )
        return super().compose_node(parent, index)


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, str | int | float | bool) and key is not None:
            raise ConfigError(f"line {key_node.start_mark.line + 1}: a mapping key must be a plain name")
        if key in seen:
            raise ConfigError(
                f"duplicate key {key!r} at line {key_node.start_mark.line + 1} "
                f"(first at line {seen[key] + 1}); each key may appear once"
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(path: str | Path) -> Any:
    """Parses a YAML file safely; duplicate keys raise `ConfigError`."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from err
    return parse_yaml(data, source=str(path))


def parse_yaml(data: bytes, *, source: str = "config") -> Any:
    """Parses YAML text safely.

    Raises:
        ConfigError: oversized, not UTF-8, not YAML, duplicate keys, aliases, or nested too deep.
    """
    text = decode_text(data, what=source, error=ConfigError, max_bytes=MAX_CONFIG_BYTES)
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML: {' '.join(str(err).split())}") from err
    except RecursionError as err:
        raise ConfigError(f"{source}: nested too deeply to be a config") from err
    check_unicode(value, what=source, error=ConfigError)
    return value


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        key = describe_location(item["loc"])
        message = " ".join(item["msg"].removeprefix("Value error, ").split())
        lines.append(f"`{key}`: {message}" if item["loc"] else message)
    return "; ".join(lines)


def _resolve_paths(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    def as_path(value: str) -> str:
        path = base / Path(value).expanduser()
        try:
            return str(path.resolve())
        except (OSError, ValueError):  # not a name this filesystem could hold: reading it will say so
            return str(path)

    def exists(value: str) -> bool:
        try:
            return (base / value).exists()
        except (OSError, ValueError):  # a name too long for the filesystem, a NUL byte: not a folder
            return False

    def as_checkpoint(value: str) -> str:
        # A checkpoint is a local folder when it exists or is written as a path; anything else
        # (e.g. "org/model") is kept as an identifier and normalised by `normalise_checkpoint`.
        looks_like_path = value.startswith((".", "/", "~")) or exists(value)
        return as_path(value) if looks_like_path else value

    out = dict(raw)
    if isinstance(out.get("teachers"), dict):
        out["teachers"] = {
            alias: as_checkpoint(ckpt) if isinstance(ckpt, str) else ckpt
            for alias, ckpt in out["teachers"].items()
        }
    if isinstance(out.get("tokenizer"), str):
        out["tokenizer"] = as_checkpoint(out["tokenizer"])
    for section, key, resolve in (
        ("data", "path", as_path),
        ("store", "path", as_path),
        ("train", "student", as_checkpoint),
        ("train", "output_dir", as_path),
    ):
        block = out.get(section)
        if isinstance(block, dict) and isinstance(block.get(key), str):
            out[section] = {**block, key: resolve(block[key])}
    train = out.get("train")
    if not isinstance(train, dict):
        return out
    init = train.get("init_from")
    if isinstance(init, str):
        out["train"] = {**train, "init_from": as_path(init)}
    elif isinstance(init, dict) and isinstance(init.get("checkpoint"), str):
        out["train"] = {**train, "init_from": {**init, "checkpoint": as_path(init["checkpoint"])}}
    return out


def parse_config(raw: Any, *, base_dir: str | Path, source: str = "config") -> MopdConfig:
    """Validates a parsed YAML document; relative paths resolve against `base_dir`.

    Raises:
        ConfigError: naming every offending key.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, found {type(raw).__name__}")
    try:
        return MopdConfig.model_validate(_resolve_paths(raw, Path(base_dir)))
    except ValidationError as err:
        raise ConfigError(f"{source}: {_format_validation_error(err)}") from err


def load_config(path: str | Path) -> MopdConfig:
    """Loads and validates a config file.

    Raises:
        ConfigError: the file is unreadable, not YAML, has duplicate keys, or fails validation.
    """
    path = Path(path)
    return parse_config(load_yaml(path), base_dir=path.resolve().parent, source=str(path))

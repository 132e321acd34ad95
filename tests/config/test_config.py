from __future__ import annotations

from pathlib import Path

import pytest

from mopd.base.errors import ConfigError
from mopd.config.mopd_config import load_config

BASE = """\
teachers:
  math: ckpts/math
  code: ckpts/code
data: {path: data/train.jsonl}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults_and_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "ckpts" / "math").mkdir(parents=True)
    config = load_config(write(tmp_path, BASE))
    assert config.teachers["math"] == str((tmp_path / "ckpts" / "math").resolve())
    assert config.data.path == str((tmp_path / "data" / "train.jsonl").resolve())
    assert config.store.dtype == "bfloat16" and config.store.codec == "shuffle-zstd1"
    assert config.agent_to_alias() == {"math": "math", "code": "code"}


def test_store_path_is_a_folder_or_a_bucket(tmp_path: Path) -> None:
    """A file:// URL is its folder, resolved like any path; a bucket URL is kept as written, with its
    client's settings beside it, never its credentials; another scheme is refused naming it."""
    folder = tmp_path / "stores" / "x.zarr"
    config = load_config(write(tmp_path, BASE + f"store: {{path: '{folder.as_uri()}'}}\n"))
    assert config.store.path == str(folder)
    bucket = "store: {path: 's3://team-bucket/x.zarr/', options: {region: eu-west-1}}\n"
    config = load_config(write(tmp_path, BASE + bucket))
    assert (config.store.path, config.store.options) == ("s3://team-bucket/x.zarr", {"region": "eu-west-1"})
    secret = "store: {path: 's3://team-bucket/x', options: {aws_secret_access_key: k}}\n"
    with pytest.raises(ConfigError, match=r"store.options.*aws_secret_access_key: credentials do not belong"):
        load_config(write(tmp_path, BASE + secret))
    refused = r"store.path.*hdfs://b/x.zarr: a store is a path, a file:// URL or an object-storage URL"
    with pytest.raises(ConfigError, match=refused):
        load_config(write(tmp_path, BASE + "store: {path: 'hdfs://b/x.zarr'}\n"))
    with pytest.raises(ConfigError, match=r"s3://x: name the bucket"):
        load_config(write(tmp_path, BASE + "store: {path: 's3://x'}\n"))


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    text = BASE.replace("  code: ckpts/code\n", "  code: ckpts/code\n  math: ckpts/other\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'math' at line 4 \(first at line 2\)"):
        load_config(write(tmp_path, text))


def test_unknown_key_is_named_with_the_closest_one(tmp_path: Path) -> None:
    """An unknown key names its section and the closest key of it (difflib's, from the section's own
    fields); with none close, the section's keys and where they are documented."""
    path = write(tmp_path, BASE + "store: {dtpye: float32}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert str(raised.value) == f"{path}: store has no key dtpye; did you mean store.dtype?"
    with pytest.raises(ConfigError) as raised:
        load_config(write(tmp_path, BASE + "store: {zzz: 1}\n"))
    assert str(raised.value).endswith(
        "store has no key zzz (its keys: path, options, dtype, codec, encoding; all are in docs/config.md)"
    )


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ("{student: s, optim: {lr: -1}}", r"`train.optim.lr`: Input should be greater than 0"),
        # tensor parallelism of an hf student: refused at load, not when the trainer starts
        (
            "{student: s, parallel: {tp: 2}}",
            r"`train.parallel`: .*the hf backend trains with data parallelism",
        ),
        (
            "{student: s, backend: fsdp, parallel: {pp: 2}}",
            r"`train.parallel`: .*the fsdp backend trains with data parallelism",
        ),
        ("{student: s, parallel: {dp_replicate: 2}}", r"dp_replicate .* is for train.backend fsdp"),
        ("{student: s, parallel: {gradient_sync: step}}", r"gradient_sync is for train.backend fsdp"),
        (
            "{student: s, dtype: bfloat16, mixed_precision: bf16}",
            r"mixed precision keeps fp32 master weights; set dtype: float32",
        ),
        ("{student: s, mixed_precision: fp16}", r"`train.mixed_precision`: Input should be 'none' or 'bf16'"),
        (
            "{student: s, backend: megatron, mixed_precision: bf16, "
            "parallel: {tp: 2, sequence_parallel: true}}",
            r"mixed_precision bf16 with parallel.sequence_parallel: .*turn sequence_parallel off",
        ),
    ],
)
def test_bad_value_is_named(tmp_path: Path, train: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, BASE + f"train: {train}\n"))


def test_sequence_parallel_without_tensor_parallelism_is_named(tmp_path: Path) -> None:
    text = BASE + "precompute: {parallel: {tp: 1, sequence_parallel: true}}\n"
    with pytest.raises(ConfigError, match=r"`precompute.parallel`: .*sequence_parallel .* needs tp ≥ 2"):
        load_config(write(tmp_path, text))
    text = BASE + "train: {student: s, backend: megatron, parallel: {tp: 2, sequence_parallel: true}}\n"
    ok = load_config(write(tmp_path, text))
    assert ok.train is not None and ok.train.parallel.sequence_parallel


def test_routing_to_unknown_alias(tmp_path: Path) -> None:
    text = BASE + "routing: {teacher_by_agent: {algebra: mathh}}\n"
    with pytest.raises(
        ConfigError, match=r"routing.teacher_by_agent.algebra: alias 'mathh' is not in teachers"
    ):
        load_config(write(tmp_path, text))


def test_routing_to_a_list_of_aliases(tmp_path: Path) -> None:
    """A list routes to several teachers; each alias in it must exist, and a list is never empty."""
    teachers = "routing: {teacher_by_agent: {algebra: [math, code]}, default_teacher: [code]}\n"
    config = load_config(write(tmp_path, BASE + teachers))
    assert config.routing.teacher_by_agent == {"algebra": ["math", "code"]}
    text = BASE + "routing: {default_teacher: [math, mathh]}\n"
    with pytest.raises(ConfigError, match=r"routing.default_teacher: alias 'mathh' is not in teachers"):
        load_config(write(tmp_path, text))
    with pytest.raises(ConfigError, match=r"routing.teacher_by_agent.algebra"):
        load_config(write(tmp_path, BASE + "routing: {teacher_by_agent: {algebra: []}}\n"))


def test_unreadable_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "teachers: [unclosed\n"))
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(("beta", "instead"), [(1.0, "reverse_kl"), (0.0, "forward_kl")])
def test_a_jsd_that_is_identically_zero_is_refused(tmp_path: Path, beta: float, instead: str) -> None:
    """mopd's JSD(β) is 0 with zero gradient at β ∈ {0, 1}; users of other tools write β = 1 for
    reverse KL. The config names the kind they mean instead of training on nothing."""
    text = BASE + f"train:\n  student: ckpts/student\n  divergence: {{kind: jsd, beta: {beta}}}\n"
    with pytest.raises(
        ConfigError,
        match=rf"`train.divergence`: kind jsd with beta {beta} is identically 0 .*kind: {instead}",
    ):
        load_config(write(tmp_path, text))
    load_config(write(tmp_path, text.replace(f"beta: {beta}", "beta: 0.5")))  # a real JSD trains


def test_teacher_weights_that_train_nothing_are_refused(tmp_path: Path) -> None:
    train = "train:\n  student: ckpts/student\n  teacher_weights: {math: 0.0, code: 0.0}\n"
    with pytest.raises(ConfigError, match=r"every teacher's weight is 0 .* nothing would train"):
        load_config(write(tmp_path, BASE + train))
    with pytest.raises(ConfigError, match=r"train.teacher_weights.math: -1.0 is negative"):
        load_config(write(tmp_path, BASE + train.replace("math: 0.0", "math: -1.0")))
    mixed = train.replace("teacher_weights", "divergence: {ce_weight: 1.0}\n  teacher_weights")
    assert load_config(write(tmp_path, BASE + mixed)).train is not None  # hard-label CE still trains
    load_config(write(tmp_path, BASE + train.replace("math: 0.0", "math: 0.5")))


def test_yaml_aliases_nan_and_oversized_configs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"YAML alias at line \d+: aliases \(\*name\) are not allowed"):
        load_config(write(tmp_path, BASE + "routing: &r {field: agent}\nother: *r\n"))
    with pytest.raises(ConfigError, match=r"`train.teacher_weights.code`: Input should be a finite number"):
        load_config(write(tmp_path, BASE + "train: {student: s, teacher_weights: {code: .nan}}\n"))
    with pytest.raises(ConfigError, match=r"bytes, more than the 1048576 it may have"):
        load_config(write(tmp_path, BASE + "#" * (1 << 20)))


def test_teacher_parallelism_is_checked_with_the_backend_that_runs(tmp_path: Path) -> None:
    """`precompute --backend vllm` may be what makes `precompute.parallel` valid, so the two are
    checked together when the backend is known."""
    config = load_config(write(tmp_path, BASE + "precompute: {parallel: {tp: 2}}\n"))
    assert config.precompute.with_backend("megatron").backend == "megatron"
    assert config.precompute.with_backend("vllm").parallel.tp == 2
    for backend in (None, "hf"):
        with pytest.raises(ConfigError, match=r"tp=2 × pp=1 needs the vllm or megatron backend"):
            config.precompute.with_backend(backend)
    split = load_config(write(tmp_path, BASE + "precompute: {parallel: {tp: 2, sequence_parallel: true}}\n"))
    with pytest.raises(ConfigError, match="sequence_parallel is the megatron backend's"):
        split.precompute.with_backend("vllm")
    megatron = load_config(write(tmp_path, BASE + "precompute: {backend: megatron, parallel: {tp: 2}}\n"))
    assert megatron.precompute.with_backend(None) is megatron.precompute

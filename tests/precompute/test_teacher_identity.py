"""A teacher is every byte that decides its outputs: a tensor changed anywhere (not only the LM head) makes
another teacher at any path, refused by verify-manifest and by a precompute resuming a partial store;
a byte-identical copy at another path is the same teacher."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mopd.cli.main import cli
from mopd.store.format.fingerprint import checkpoint_fingerprint
from tests.precompute.conftest import write_config
from tests.precompute.teachers import mixed_records, write_jsonl

BODY_TENSOR = "model.layers.1.mlp.down_proj.weight"


def scale_tensor(checkpoint: Path, name: str, factor: float) -> None:
    weights = load_file(checkpoint / "model.safetensors")
    weights[name] = weights[name] * factor
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def setup(tmp_path: Path, tiny_teachers: dict[str, Path]) -> dict[str, Path]:
    """Two teachers copied under tmp_path (a-math, b-code: their order is fixed by these names)."""
    math = Path(shutil.copytree(tiny_teachers["llama"], tmp_path / "ckpt" / "a-math"))
    code = Path(shutil.copytree(tiny_teachers["qwen2"], tmp_path / "ckpt" / "b-code"))
    records = [{**r, "agent": "math" if i % 2 else "code"} for i, r in enumerate(mixed_records(6))]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    return {"math": math, "code": code, "data": data, "root": tmp_path}


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [*args])
    return result.exit_code, " ".join((result.stdout + result.stderr).split())


def test_a_changed_body_tensor_is_another_teacher_at_any_path(setup: dict[str, Path]) -> None:
    root = setup["root"]
    config = write_config(root, {"math": setup["math"], "code": setup["code"]}, data=setup["data"])
    assert run("precompute", str(config))[0] == 0
    store = str(root / "store.zarr")
    before = checkpoint_fingerprint(setup["code"])

    same = Path(shutil.copytree(setup["code"], root / "ckpt" / "c-code-copy"))  # sorts after a-math too
    (root / "moved").mkdir()
    moved = write_config(
        root / "moved", {"math": setup["math"], "code": same}, data=setup["data"], store=store
    )
    code, output = run("verify-manifest", store, "--config", str(moved))
    assert code == 0 and output.startswith("ok:"), output

    scale_tensor(same, BODY_TENSOR, 1.5)
    after = checkpoint_fingerprint(same)
    assert after != before
    code, output = run("verify-manifest", store, "--config", str(moved))
    assert code == 1
    assert "teacher 1 (code)" in output and str(setup["code"]) in output and str(same) in output
    assert before in output and after in output and "a different teacher" in output


def test_precompute_refuses_a_teacher_changed_under_a_partial_store(setup: dict[str, Path]) -> None:
    root = setup["root"]
    config = write_config(root, {"math": setup["math"], "code": setup["code"]}, data=setup["data"])
    assert run("precompute", str(config), "--num-tasks", "3", "--task-index", "0")[0] == 0
    before = checkpoint_fingerprint(setup["code"])
    scale_tensor(setup["code"], BODY_TENSOR, 1.5)
    code, output = run("precompute", str(config))
    assert code == 1, output
    assert f"teacher code ({setup['code']}) changed since the store was started" in output
    assert before in output and checkpoint_fingerprint(setup["code"]) in output
    assert not (root / "store.zarr" / "manifest.json").exists()


def test_fingerprint_covers_weights_config_tokenizer_and_code(
    tmp_path: Path, tiny_teachers: dict[str, Path]
) -> None:
    base = checkpoint_fingerprint(tiny_teachers["llama"])
    for name, change in [
        ("weights", lambda c: scale_tensor(c, "model.layers.0.self_attn.q_proj.weight", -1.0)),
        ("norm", lambda c: scale_tensor(c, "model.norm.weight", 2.0)),
        (
            "tokenizer",
            lambda c: (c / "tokenizer_config.json").write_text(
                (c / "tokenizer_config.json").read_text().replace("}", ', "model_max_length": 7}', 1)
            ),
        ),
        ("code", lambda c: (c / "modeling_extra.py").write_text("SCALE = 2\n")),
        (
            "softcap",
            lambda c: (c / "config.json").write_text(
                (c / "config.json").read_text().replace("{", '{"final_logit_softcapping": 30.0, ', 1)
            ),
        ),
    ]:
        copy = Path(shutil.copytree(tiny_teachers["llama"], tmp_path / name))
        assert checkpoint_fingerprint(copy) == base, name  # a copy elsewhere is the same teacher
        change(copy)
        assert checkpoint_fingerprint(copy) != base, name


def test_trust_remote_code_is_part_of_the_store_identity(setup: dict[str, Path]) -> None:
    root = setup["root"]
    config = write_config(root, {"math": setup["math"], "code": setup["code"]}, data=setup["data"])
    assert run("precompute", str(config), "--num-tasks", "3", "--task-index", "0")[0] == 0
    trusting = write_config(
        root,
        {"math": setup["math"], "code": setup["code"]},
        data=setup["data"],
        precompute={"trust_remote_code": True},
    )
    code, output = run("precompute", str(trusting))
    assert code == 1 and "already holds a store of a different run (precompute or storage settings)" in output

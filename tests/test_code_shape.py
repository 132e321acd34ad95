"""The shape the library keeps: `run_precompute` reads top to bottom in at most 40 lines, and no
function of store/, precompute/, train/ or rollout/ runs over 60 lines of code.

A function's length is its lines from `def` to its last line, less its docstring: the public kernel
and loader functions document every argument, and that documentation is not what makes a function
hard to read.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("store", "precompute", "train", "rollout")
MAX_LINES = 60
RUN_PRECOMPUTE_LINES = 40


def code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    assert node.end_lineno is not None
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        assert first.end_lineno is not None
        lines -= first.end_lineno - first.lineno + 1
    return lines


def functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def test_run_precompute_reads_top_to_bottom() -> None:
    (run,) = [f for f in functions(REPO / "precompute" / "runner.py") if f.name == "run_precompute"]
    assert run.end_lineno is not None
    assert run.end_lineno - run.lineno + 1 <= RUN_PRECOMPUTE_LINES  # docstring included


def test_no_function_runs_over_60_lines() -> None:
    long = [
        f"{path.relative_to(REPO)}:{f.lineno} {f.name} ({code_lines(f)} lines)"
        for folder in FOLDERS
        for path in sorted((REPO / folder).rglob("*.py"))
        for f in functions(path)
        if code_lines(f) > MAX_LINES
    ]
    assert long == []


def test_the_count_leaves_out_the_docstring_only(tmp_path: Path) -> None:
    source = tmp_path / "f.py"
    source.write_text(
        'def f():\n    """Two\n    lines."""\n    a = 1\n    return a\n\n\ndef g():\n    return "x"\n'
    )
    assert [code_lines(f) for f in functions(source)] == [3, 2]

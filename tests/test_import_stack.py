"""Guard: store/ at the bottom, then mcore/ (Megatron-core models); precompute/ and train/ above them,
never importing each other; cli/ on top."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("store", "mcore", "precompute", "train", "cli")
ALLOWED = {
    "store": {"store"},
    "mcore": {"store", "mcore"},
    "precompute": {"store", "mcore", "precompute"},
    "train": {"store", "mcore", "train"},
    "cli": {"store", "mcore", "precompute", "train", "cli"},
}
# The store is read by plain numerical code; distributed process groups belong to the trainer.
FORBIDDEN_MODULES = {"store": ("torch.distributed", "click", "transformers")}


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_layers_import_only_downwards() -> None:
    violations = []
    checked = 0
    for layer in LAYERS:
        for path in sorted((REPO / layer).rglob("*.py")) if (REPO / layer).exists() else []:
            checked += 1
            for module in imported_modules(path):
                parts = module.split(".")
                if parts[0] == "mopd" and len(parts) > 1 and parts[1] not in ALLOWED[layer]:
                    violations.append(f"{path.relative_to(REPO)} imports {module}")
                if any(
                    module == bad or module.startswith(bad + ".") for bad in FORBIDDEN_MODULES.get(layer, ())
                ):
                    violations.append(f"{path.relative_to(REPO)} imports {module}")
    assert checked > 10
    assert violations == []


def test_guard_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from mopd.train.divergence import linear_divergence\nimport torch.distributed as dist\n")
    assert imported_modules(bad) == ["mopd.train.divergence", "torch.distributed"]


def test_the_cli_and_the_store_metadata_import_no_torch() -> None:
    """`mopd --help`, `verify-manifest` and `inspect` start in a fraction of a second: torch (over a
    second to import) loads only for the commands that run models or read tensors, and zarr-python
    (0.2 s) only for those that write arrays."""
    import subprocess
    import sys

    probe = (
        "import sys, mopd.cli.main, mopd.store.verify, mopd.store.summary, mopd.store\n"
        "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'zarr') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

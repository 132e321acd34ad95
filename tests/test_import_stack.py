"""Guard: store/ at the bottom, then config/ (the YAML config's model, which the store never needs),
mcore/ (Megatron-core models); precompute/ and train/ above them, never importing each other; rollout/
(the student's own samples, rounds of sample, score, train) above both; cli/ on top."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("store", "config", "mcore", "precompute", "train", "rollout", "cli")
ALLOWED = {
    "store": {"store"},
    "config": {"store", "config"},
    "mcore": {"store", "config", "mcore"},
    "precompute": {"store", "config", "mcore", "precompute"},
    "train": {"store", "config", "mcore", "train"},
    "rollout": {"store", "config", "mcore", "precompute", "train", "rollout"},
    "cli": {"store", "config", "mcore", "precompute", "train", "rollout", "cli"},
}
# The store is read by plain numerical code; distributed process groups belong to the trainer. mcore
# takes its parallel layout from the config package, never from the store's config module.
FORBIDDEN_MODULES = {
    "store": ("torch.distributed", "click", "transformers"),
    "mcore": ("mopd.store.config",),
}


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


def test_the_store_defines_only_its_own_config_section() -> None:
    """Training, optimiser and parallelism settings live in config/, not in the store."""
    sections = [
        f"{path.relative_to(REPO)}:{node.name}"
        for path in sorted((REPO / "store").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "Section" for b in node.bases)
    ]
    assert sections == ["store/config.py:StoreConfig"]


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

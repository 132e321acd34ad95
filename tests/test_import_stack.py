"""Guard: base/ at the bottom (what every layer uses and is not about the store); config/ (the YAML
config's model) and store/ (the teacher store) peers above it, neither importing the other; mcore/
(Megatron-core models) on config/; precompute/ and train/ above them, never importing each other;
rollout/ (the student's own samples, rounds of sample, score, train) above both; cli/ on top."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("base", "config", "store", "mcore", "precompute", "train", "rollout", "cli")
ALLOWED = {
    "base": {"base"},
    "config": {"base", "config"},
    "store": {"base", "store"},
    "mcore": {"base", "config", "mcore"},
    "precompute": {"base", "config", "store", "mcore", "precompute"},
    "train": {"base", "config", "store", "mcore", "train"},
    "rollout": {"base", "config", "store", "mcore", "precompute", "train", "rollout"},
    "cli": {"base", "config", "store", "mcore", "precompute", "train", "rollout", "cli"},
}
# The store and the base are read by plain numerical code; distributed process groups belong to the
# trainer.
FORBIDDEN_MODULES = {
    "base": ("torch.distributed", "click", "transformers"),
    "store": ("torch.distributed", "click", "transformers"),
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


def test_config_sections_live_in_the_config_package() -> None:
    """Every section of the YAML config, the store's included, is defined in config/."""
    sections = [
        f"{path.relative_to(REPO)}:{node.name}"
        for layer in LAYERS
        for path in sorted((REPO / layer).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "Section" for b in node.bases)
    ]
    assert "config/store.py:StoreConfig" in sections
    assert [s for s in sections if not s.startswith("config/")] == []


def test_guard_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from mopd.train.kernel.divergence import linear_divergence\nimport torch.distributed as dist\n"
    )
    assert imported_modules(bad) == ["mopd.train.kernel.divergence", "torch.distributed"]


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


ROOMS = {
    "store": {"arrays", "codec", "format", "locations"},
    "train": {"backends", "checkpoint", "data", "kernel", "report"},
}
MAX_TOP_MODULES = 12


def test_store_and_train_are_divided_into_rooms() -> None:
    """At most 12 modules at the top of store/ and train/; the rest in rooms (subpackages), each with a
    docstring that says what lives there."""
    for layer, rooms in ROOMS.items():
        top = sorted(p.name for p in (REPO / layer).glob("*.py") if p.name != "__init__.py")
        assert len(top) <= MAX_TOP_MODULES, f"{layer}/ holds {len(top)} modules at its top: {top}"
        found = {p.parent.name for p in (REPO / layer).glob("*/__init__.py")}
        assert found == rooms, f"{layer}/'s rooms are {sorted(found)}; this test names {sorted(rooms)}"
        for room in rooms:
            doc = ast.get_docstring(ast.parse((REPO / layer / room / "__init__.py").read_text()))
            assert doc and len(doc) > 80, f"{layer}/{room}/__init__.py: say what lives there"


def room_violations(kernel: Path) -> list[str]:
    """Imports of the rest of mopd.train from modules of train/kernel/."""
    return [
        f"{path.relative_to(kernel.parent.parent)} imports {module}"
        for path in sorted(kernel.rglob("*.py"))
        for module in imported_modules(path)
        if module.startswith("mopd.train.") and not module.startswith("mopd.train.kernel")
    ]


def test_the_kernel_imports_nothing_else_of_train(tmp_path: Path) -> None:
    """The divergence kernel stands alone (its parity tests and benchmarks need nothing of the trainer),
    and the check would see a module that broke that."""
    assert room_violations(REPO / "train" / "kernel") == []
    bad = tmp_path / "train" / "kernel"
    bad.mkdir(parents=True)
    (bad / "divergence.py").write_text("from mopd.train.heads import TeacherHeads\n")
    assert room_violations(bad) == ["train/kernel/divergence.py imports mopd.train.heads"]

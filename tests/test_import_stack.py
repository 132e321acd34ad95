"""Guard: base/ at the bottom (what every layer uses and is not about the store), tokens/ (tokenizers
and the ties between two of them) on it; config/ (the YAML
config's model) and store/ (the teacher store) peers above it, neither importing the other; mcore/
(Megatron-core models) on config/; precompute/ and train/ above them, never importing each other;
rollout/ (the student's own samples, rounds of sample, score, train) above both; cli/ on top."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("base", "tokens", "config", "store", "mcore", "precompute", "train", "rollout", "cli")
ALLOWED = {
    "base": {"base"},
    "tokens": {"base", "tokens"},
    "config": {"base", "config"},
    "store": {"base", "store"},
    "mcore": {"base", "config", "mcore"},
    "precompute": {"base", "tokens", "config", "store", "mcore", "precompute"},
    "train": {"base", "tokens", "config", "store", "mcore", "train"},
    "rollout": {"base", "tokens", "config", "store", "mcore", "precompute", "train", "rollout"},
    "cli": {"base", "tokens", "config", "store", "mcore", "precompute", "train", "rollout", "cli"},
}
# The store and the base are read by plain numerical code; distributed process groups belong to the
# trainer.
FORBIDDEN_MODULES = {
    "base": ("torch.distributed", "click", "transformers"),
    "tokens": ("torch.distributed", "click"),
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


# Each layer's rooms, lowest first: a room imports only rooms before it (the kernel, first, nothing else
# of train/), never the top of its layer, which may import them all.
ROOM_ORDER = {
    "store": ("locations", "arrays", "format", "codec"),
    "train": ("kernel", "data", "backends", "report", "checkpoint"),
}


def _room_of(root: Path, layer: str, module: str) -> str | None:
    """The room of `layer` that `module` is in ("" for the layer's top), None outside the layer."""
    parts = module.split(".")
    if parts[:2] != ["mopd", layer]:
        return None
    return parts[2] if len(parts) > 2 and (root / layer / parts[2]).is_dir() else ""


def room_violations(root: Path, layer: str) -> list[str]:
    """Imports from a room of `layer` (under `root`) of a later room or of the layer's top."""
    order = ROOM_ORDER[layer]
    found = []
    for index, room in enumerate(order):
        for path in sorted((root / layer / room).rglob("*.py")):
            for module in imported_modules(path):
                target = _room_of(root, layer, module)
                if target is not None and target != room and target not in order[:index]:
                    found.append(f"{path.relative_to(root)} imports {module}")
    return found


def test_rooms_import_only_earlier_rooms() -> None:
    assert room_violations(REPO, "store") == []
    assert room_violations(REPO, "train") == []


def test_a_back_import_between_rooms_is_caught(tmp_path: Path) -> None:
    """The kernel importing the trainer's heads, the array reader the manifest, a report the top."""
    for folder in ("train/kernel", "train/report", "store/arrays", "store/format"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "train/kernel/divergence.py").write_text("from mopd.train.heads import TeacherHeads\n")
    (tmp_path / "train/report/memory.py").write_text(
        "from mopd.train.kernel.gemm import x\nimport mopd.train.session\n"
    )
    (tmp_path / "store/arrays/read.py").write_text("from mopd.store.format.manifest import PARTS_DIR\n")
    assert room_violations(tmp_path, "train") == [
        "train/kernel/divergence.py imports mopd.train.heads",
        "train/report/memory.py imports mopd.train.session",
    ]
    assert room_violations(tmp_path, "store") == ["store/arrays/read.py imports mopd.store.format.manifest"]


def test_the_store_reads_nothing_of_the_checkpoint_format() -> None:
    """A training checkpoint's state.json is train/checkpoint/'s to read (`verify-manifest --checkpoint`
    calls it beside the store's checks)."""
    readers = [
        str(p.relative_to(REPO))
        for p in sorted((REPO / "store").rglob("*.py"))
        if "state.json" in p.read_text()
    ]
    assert readers == []

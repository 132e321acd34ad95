"""mopd.store: the on-disk teacher store (format, writers, readers, verification)."""

from typing import TYPE_CHECKING, Any

from mopd.base.errors import (
    ConfigError,
    FilesystemError,
    ManifestError,
    MopdError,
    StoreIncompleteError,
    StoreIntegrityError,
)
from mopd.base.version import __version__
from mopd.store.format.manifest import FORMAT, FORMAT_VERSION, Manifest

if TYPE_CHECKING:
    from mopd.store.reader import Row, TeacherStore, open_store

_READER = ("Row", "TeacherStore", "open_store")


def __getattr__(name: str) -> Any:
    """The read API on first use: the reader imports torch, which the metadata commands
    (`verify-manifest`, `inspect`) never need."""
    if name in _READER:
        from mopd.store import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'mopd.store' has no attribute {name!r}")


__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ConfigError",
    "FilesystemError",
    "Manifest",
    "ManifestError",
    "MopdError",
    "Row",
    "StoreIncompleteError",
    "StoreIntegrityError",
    "TeacherStore",
    "__version__",
    "open_store",
]

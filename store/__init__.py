"""mopd.store: the on-disk teacher store (format, writers, readers, verification)."""

from mopd.store.errors import (
    ConfigError,
    FilesystemError,
    ManifestError,
    MopdError,
    StoreIncompleteError,
    StoreIntegrityError,
)
from mopd.store.manifest import FORMAT, FORMAT_VERSION, Manifest
from mopd.store.reader import Row, TeacherStore, open_store
from mopd.store.version import __version__

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

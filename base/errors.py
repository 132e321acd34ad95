"""Errors for bad input and bad data. Each message says what was found, what was expected, and the fix."""


class MopdError(ValueError):
    """Base class of every error mopd raises for a problem the user can fix."""


class ConfigError(MopdError):
    """The YAML config is malformed or names something that does not exist."""


class ManifestError(MopdError):
    """A manifest, plan or part record is missing, unreadable or of an unsupported version."""


class StoreIntegrityError(MopdError):
    """Stored bytes disagree with what the manifest or a part record says about them."""


class StoreIncompleteError(MopdError):
    """The store has no manifest yet because some tasks have not finished."""


class FilesystemError(MopdError):
    """The filesystem lacks a guarantee the commit protocol relies on."""


class CheckpointError(MopdError):
    """A training checkpoint is incomplete, damaged, or was trained on something else."""


class OutOfMemoryError(MopdError):
    """An allocation failed; the message names the settings that bound memory and their values."""

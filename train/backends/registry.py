"""The backends by name: the one place that maps `train.backend` (or a checkpoint's layout) to the module
that implements it. Each is imported when first asked for (megatron-core only where it runs)."""

from __future__ import annotations

import importlib

from mopd.train.backends.protocol import Backend, BackendName


def backend(name: BackendName) -> Backend:
    """The entry points of the backend called `name` (`mopd.train.backends.<name>.BACKEND`)."""
    found: Backend = importlib.import_module(f"mopd.train.backends.{name}").BACKEND
    return found

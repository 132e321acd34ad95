"""A student's divergence per teacher over a whole store, outside any training run (the held-out
measure of `mopd rounds`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mopd.config.mopd_config import MopdConfig
from mopd.train.checkpoint.resume import init_checkpoint
from mopd.train.checkpoint.state import load_weights
from mopd.train.report.metrics import EvalRecord
from mopd.train.session import Log, open_session
from mopd.train.store_check import check_store


def evaluate_student(config: MopdConfig, *, store_path: str | Path, log: Log = print) -> EvalRecord:
    """The divergence per teacher, over every trained token of a store, of the student that
    `train.init_from` names (else `train.student`): what `train.eval` measures on held-out rows.

    Builds a session only: no optimiser, no data order, no optimiser state loaded.
    """
    with open_session(config, store_path=store_path, log=log) as session:
        check_store(
            config, session.store.manifest, session.store.location, world=session.world, log=session.log
        )
        init = session.config.init_from
        if init is not None:
            found = init_checkpoint(init, layout=session.student.layout, world=session.world)
            load_weights(found.folder, found.state, session.student, None, hyper_parameters=False)
        return session.evaluate(np.arange(session.store.num_rows), step=0)

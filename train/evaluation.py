"""A student's divergence per teacher over a whole store, outside any training run (the held-out
measure of `mopd rounds`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mopd.config.mopd_config import MopdConfig
from mopd.config.train import EvalConfig
from mopd.train.metrics import EvalRecord
from mopd.train.trainer import Log, Trainer


def evaluate_student(config: MopdConfig, *, store_path: str | Path, log: Log = print) -> EvalRecord:
    """The divergence per teacher, over every trained token of a store, of the student that
    `train.init_from` names (else `train.student`): what `train.eval` measures on held-out rows."""
    quiet = config.train.model_copy(update={"eval": EvalConfig()}) if config.train is not None else None
    trainer = Trainer(config.model_copy(update={"train": quiet}), store_path=store_path, log=log)
    try:
        trainer.start_from()
        trainer.eval_rows = np.arange(trainer.store.num_rows)
        return trainer.evaluate(0)
    finally:
        trainer.student.close()
        trainer.world.close()

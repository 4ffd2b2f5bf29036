"""Checkpoints: DCP sharded saves and exact resume (checkpointer.py), what they hold
(state.py), safe reading (files.py), formats and conversion (formats.py, convert.py, hf.py)."""

from freetx.checkpoint.checkpointer import CheckpointConfig, Checkpointer, build_meta
from freetx.checkpoint.convert import (
    convert,
    inspect_report,
    load_initial_weights,
    model_from_checkpoint,
    resolve_checkpoint,
)
from freetx.checkpoint.formats import open_tensors
from freetx.checkpoint.run_folder import step_name
from freetx.checkpoint.state import (
    ModelState,
    OptimizerState,
    PerRankState,
    TrainState,
    training_state,
)

__all__ = [
    "CheckpointConfig",
    "Checkpointer",
    "ModelState",
    "OptimizerState",
    "PerRankState",
    "TrainState",
    "build_meta",
    "convert",
    "inspect_report",
    "load_initial_weights",
    "model_from_checkpoint",
    "open_tensors",
    "resolve_checkpoint",
    "step_name",
    "training_state",
]

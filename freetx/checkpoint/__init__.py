"""Checkpoints: DCP sharded saves and exact resume (checkpointer.py; saver.py writes the
saves), the run folder's guard and which checkpoint a path means (run_folder.py), what
they hold (state.py), a DCP folder read safely (dcp_folder.py), formats and conversion
(formats.py, convert.py; written through freetx/user_files.py), reading weights into a
model (loading.py: survey, check, load; HF layouts are the models' own,
freetx.models.hf)."""

from freetx.checkpoint.checkpointer import CheckpointConfig, Checkpointer, build_meta
from freetx.checkpoint.convert import convert, inspect_report, merge
from freetx.checkpoint.dcp_folder import step_name
from freetx.checkpoint.formats import open_tensors
from freetx.checkpoint.identity import ReadsFiles, files_read_by, input_identity
from freetx.checkpoint.loading import (
    load_initial_weights,
    load_model,
    load_source_model,
    model_from_checkpoint,
    source_model_on_meta,
)
from freetx.checkpoint.run_folder import resolve_checkpoint
from freetx.checkpoint.state import (
    LRSchedulerState,
    ModelState,
    OptimizerState,
    PerRankState,
    ScalerState,
    TrainState,
)

__all__ = [
    "ReadsFiles",
    "files_read_by",
    "input_identity",
    "CheckpointConfig",
    "LRSchedulerState",
    "Checkpointer",
    "ModelState",
    "OptimizerState",
    "PerRankState",
    "ScalerState",
    "TrainState",
    "build_meta",
    "convert",
    "inspect_report",
    "load_initial_weights",
    "load_model",
    "load_source_model",
    "source_model_on_meta",
    "merge",
    "model_from_checkpoint",
    "open_tensors",
    "resolve_checkpoint",
    "step_name",
]

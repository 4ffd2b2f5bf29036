"""Reading weights into a model: a run's initial weights (`load_initial_weights`), a
whole model rebuilt from a checkpoint (`load_model`), and which checkpoint a path means
(`resolve_checkpoint`: a run's output_dir means its newest complete checkpoint).

Every format `open_tensors` reads works here: DCP folders (resharded through DCP),
safetensors files and HF folders (each rank reads only the rows of its own shard).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from freetx.checkpoint.adapters import refuse_adapters
from freetx.checkpoint.files import (
    MODEL_PREFIX,
    SafeLoadPlanner,
    checkpoint_model_shapes,
    held_here,
    mismatch_report,
    model_shapes,
    quiet_single_process,
    read_dcp_metadata,
)
from freetx.checkpoint.formats import DCPSource, open_tensors, skipped_note
from freetx.checkpoint.run_folder import LATEST_FILE, choose_checkpoint, survey
from freetx.checkpoint.state import ModelState
from freetx.distributed import dtype_named
from freetx.distributed.init import (
    init_from_weights,
    load_parameters,
    self_initialized,
    self_stored,
    set_full_parameter,
)
from freetx.errors import CheckpointError


def load_initial_weights(model: nn.Module, path: str | Path) -> list[str]:
    """Set a (parallelized) model's weights from a safetensors file, DCP folder or HF folder.

    Every rank calls it. Keys and shapes are checked first; a mismatch lists the
    offending tensors. Adapters (parameters a module initializes itself) are not
    expected in the file and keep their values. DCP checkpoints reshard through
    DCP; from safetensors files (one, or an HF folder's shards) each rank reads
    only the rows of its own shard, a tensor at a time. Afterwards, values that
    follow from the weights (DoRA's magnitudes) are set. Returns lines naming what of the
    file is not read (a multimodal folder's vision tower), for the run's output.
    """
    source = open_tensors(resolve_checkpoint(path))  # a run's output_dir: its newest
    inner = getattr(model, "module", model)
    adapters = set(self_initialized(inner))
    expected = {n: s for n, s in model_shapes(model).items() if n not in adapters}
    if isinstance(source, DCPSource):
        found = held_here(model, checkpoint_model_shapes(read_dcp_metadata(source.path)))
        _check_fits(expected, found, path)
        stored = self_stored(inner)  # e.g. NF4 bases: quantized from the full weight
        state = ModelState(model, include=lambda name: name not in adapters | stored)
        with quiet_single_process():  # a run always has a process group; tests may not
            dcp.load({"model": state}, checkpoint_id=str(source.path), planner=SafeLoadPlanner())
        for name in sorted(stored):
            set_full_parameter(inner, name, source.get(MODEL_PREFIX + name))
    else:
        found = {n: source.infos[MODEL_PREFIX + n].shape for n in source.model_names()}
        _check_fits(expected, held_here(model, found), path)
        load_parameters(
            inner,
            lambda name, rows, out: source.read_into(MODEL_PREFIX + name, rows, out),
            only=lambda name: name not in adapters,
        )
    init_from_weights(inner)
    return skipped_note(source)


def _check_fits(expected: dict[str, tuple], found: dict[str, tuple], path) -> None:
    problems = mismatch_report(expected, found)
    if problems:
        raise CheckpointError(
            f"initial weights {path} do not fit this model ({len(problems)} difference(s)):\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nUse weights of this model shape, or change the model config to match them."
        )


def resolve_checkpoint(path: str | Path) -> Path:
    """A run's output_dir or checkpoints/ folder (its newest complete checkpoint, found as
    a resume finds it), or a checkpoint itself."""
    path = Path(path).expanduser()
    for checkpoints in (path / "checkpoints", path):
        if (checkpoints / LATEST_FILE).exists() or survey(checkpoints):
            plan = choose_checkpoint(checkpoints, "auto", overwrite=False)
            if plan.path is not None:
                return plan.path
    return path


def model_from_checkpoint(path: str | Path):
    """(model class path, model config) that a checkpoint recorded, for building its model."""
    source = open_tensors(path)
    model_class = source.meta.get("model_class")
    if model_class is None or source.model_config is None:
        raise CheckpointError(
            f"{path} does not record which model it holds (no meta.json / freetx metadata); "
            "give the model in the config instead."
        )
    return model_class, source.model_config


def load_model(path: str | Path, device, seed: int = 0) -> nn.Module:
    """The model a checkpoint holds (a run's output_dir, a DCP folder, a .safetensors file
    freetx wrote, or an HF folder of the decoder family), rebuilt from what it recorded,
    its weights loaded, on `device`, in eval mode. Not sharded: for sampling and for
    reading activations."""
    from freetx.distributed.init import materialize
    from freetx.models import build_model

    resolved = resolve_checkpoint(path)
    refuse_adapters(open_tensors(resolved), "loaded as a model")
    model_class, model_config = model_from_checkpoint(resolved)
    with torch.device("meta"):
        model = build_model(model_class, model_config)
    materialize(model, device, seed=seed, init_weights=False)
    load_initial_weights(model, resolved)
    return model.eval()


def load_source_model(path: str, device: torch.device, dtype: str = "auto") -> nn.Module:
    """A frozen model to read activations from: the model of a run, a checkpoint or an HF
    folder (`load_model`: freetx's own where it reads the folder's model_type natively,
    else transformers' through the generic path, as `freetx.models.hf_model` chooses).
    `dtype`: float32, bfloat16, or auto (bf16 on CUDA)."""
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    return load_model(path, device).to(dtype_named(dtype))


def source_model_on_meta(path: str) -> nn.Module:
    """The model `load_source_model` reads from `path`, on the meta device: its shapes and
    parameter count from what the checkpoint recorded or the HF folder's config.json,
    without reading a weight (`freetx estimate`)."""
    from freetx.models import build_model, hf_model

    with torch.device("meta"):
        if (Path(path).expanduser() / "config.json").is_file():  # an HF folder, weights or not
            return hf_model(str(Path(path).expanduser()))
        return build_model(*model_from_checkpoint(resolve_checkpoint(path)))

"""`freetx checkpoint inspect / convert`, and initial weights for a run.

Conversion streams: tensors are read one at a time from the source and written
straight to the destination (safetensors and HF folders), so converting a
checkpoint holds about one model's worth of memory at most, never model +
optimizer. No process group is needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from freetx.checkpoint.files import (
    DCP_ERRORS,
    META_FILE,
    MODEL_PREFIX,
    SafeLoadPlanner,
    check_model_matches,
    describe_dcp_error,
    mismatch_report,
    model_shapes,
    quiet_single_process,
    read_dcp_metadata,
)
from freetx.checkpoint.formats import (
    MODEL_CLASS_KEY,
    MODEL_CONFIG_KEY,
    DCPSource,
    SafetensorsStreamWriter,
    TensorInfo,
    TensorSource,
    open_tensors,
)
from freetx.checkpoint.run_folder import LATEST_FILE, choose_checkpoint, survey
from freetx.checkpoint.safe_write import check_destination, staged_output
from freetx.checkpoint.state import ModelState
from freetx.distributed.init import fill_parameters
from freetx.errors import CheckpointError
from freetx.models.hf import layout_of

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FORMATS = ("safetensors", "torch", "dcp", "hf")
MODEL_ONLY_FORMATS = ("safetensors", "hf")


def output_format(dst: Path, to: str | None) -> str:
    if to:
        return to
    if dst.suffix == ".safetensors":
        return "safetensors"
    if dst.suffix in (".pt", ".pth", ".bin"):
        return "torch"
    raise CheckpointError(
        f"cannot tell the output format from {dst}: name it *.safetensors or *.pt, or pass "
        "--to safetensors|torch|dcp|hf."
    )


def convert(
    src: str | Path,
    dst: str | Path,
    to: str | None = None,
    dtype: str | None = None,
    model_only: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Convert a checkpoint; returns what was written (format, tensors, bytes).

    The destination is written under a temporary name and renamed into place
    (`safe_write`): it may not be, hold or lie inside the source, and an
    existing one is replaced only with `overwrite`.
    """
    source = open_tensors(src)
    dst = Path(dst).expanduser()
    fmt = output_format(dst, to)
    if fmt not in FORMATS:
        raise CheckpointError(f"unknown format {fmt}; use one of {', '.join(FORMATS)}.")
    check_destination(source.path, dst, overwrite)
    if fmt in MODEL_ONLY_FORMATS:
        model_only = True
    if not source.model_names():
        raise CheckpointError(f"{src} holds no model tensors (no `model.*` entries).")
    names = [n for n in source.infos if n.startswith(MODEL_PREFIX) or not model_only]
    target = DTYPES[dtype] if dtype else None

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(target) if target is not None and tensor.is_floating_point() else tensor

    def out_dtype(info: TensorInfo) -> torch.dtype:
        return target if target is not None and info.dtype.is_floating_point else info.dtype

    with staged_output(dst) as out:
        if fmt == "safetensors":
            strip = lambda n: n[len(MODEL_PREFIX) :]  # noqa: E731
            written = _write_safetensors(source, out, strip, cast, out_dtype)
        elif fmt == "hf":
            written = _write_hf(source, out, cast, out_dtype)
        elif fmt == "torch":
            data = {
                (n[len(MODEL_PREFIX) :] if model_only else n): cast(source.get(n)) for n in names
            }
            if not model_only:
                data.update(_extras(source))
            torch.save(data, out)
            written = sum(v.numel() * v.element_size() for v in data.values() if torch.is_tensor(v))
        else:
            written = _write_dcp(source, out, names, cast, model_only)
    return {"format": fmt, "tensors": len(names), "bytes": written, "path": str(dst)}


def _write_dcp(source: TensorSource, out: Path, names: list[str], cast, model_only: bool) -> int:
    state: dict[str, Any] = {n: cast(source.get(n)) for n in names}
    if not model_only:
        state.update(_extras(source))
    try:
        with quiet_single_process():
            dcp.save(state, checkpoint_id=str(out), no_dist=True)
    except DCP_ERRORS as e:
        raise OSError(describe_dcp_error(e)) from None
    if source.model_config is not None:
        meta = {k: v for k, v in source.meta.items() if k != "step"}
        meta["model_config"] = source.model_config
        (out / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
    return sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))


def _extras(source: TensorSource) -> dict[str, Any]:
    if isinstance(source, DCPSource):
        return {name: source.get_extra(name) for name in source.extras}
    return dict(source.extras)


def _write_safetensors(source: TensorSource, dst: Path, rename, cast, out_dtype) -> int:
    infos = {
        rename(MODEL_PREFIX + n): TensorInfo(source.infos[MODEL_PREFIX + n].shape,
                                             out_dtype(source.infos[MODEL_PREFIX + n]))
        for n in source.model_names()
    }  # fmt: skip
    metadata = {"format": "pt"}
    if source.model_config is not None:
        metadata[MODEL_CONFIG_KEY] = json.dumps(source.model_config)
    if source.meta.get("model_class"):
        metadata[MODEL_CLASS_KEY] = source.meta["model_class"]
    writer = SafetensorsStreamWriter(dst, infos, metadata)
    for name in source.model_names():
        writer.write(rename(MODEL_PREFIX + name), cast(source.get(MODEL_PREFIX + name)))
    writer.close()
    return sum(info.nbytes for info in infos.values())


def _write_hf(source: TensorSource, dst: Path, cast, out_dtype) -> int:
    """config.json and model.safetensors in the HF layout the model class names."""
    if source.model_config is None or not source.meta.get("model_class"):
        raise CheckpointError(
            f"{source.path} does not record its model class and config, which config.json "
            "needs; convert from the DCP checkpoint (its meta.json has them) or from a "
            "safetensors file freetx wrote."
        )
    layout = layout_of(source.meta["model_class"])
    dst.mkdir(parents=True, exist_ok=True)
    first = source.infos[MODEL_PREFIX + source.model_names()[0]]
    dtype_name = str(out_dtype(first)).removeprefix("torch.")
    (dst / "config.json").write_text(
        json.dumps(layout.to_hf_config(source.model_config, dtype_name), indent=2)
    )
    return _write_safetensors(
        source,
        dst / "model.safetensors",
        lambda n: layout.to_hf_name(n[len(MODEL_PREFIX) :]),
        cast,
        out_dtype,
    )


def load_initial_weights(model: nn.Module, path: str | Path) -> None:
    """Set a (parallelized) model's weights from a safetensors file, DCP folder or HF folder.

    Every rank calls it. Keys and shapes are checked first; a mismatch lists the
    offending tensors. DCP checkpoints reshard through DCP; files are read one
    tensor at a time and each rank keeps its shard.
    """
    source = open_tensors(path)
    if isinstance(source, DCPSource):
        check_model_matches(read_dcp_metadata(source.path), model, source.path)
        with quiet_single_process():  # a run always has a process group; tests may not
            dcp.load(
                {"model": ModelState(model)},
                checkpoint_id=str(source.path),
                planner=SafeLoadPlanner(),
            )
        return
    found = {n: source.infos[MODEL_PREFIX + n].shape for n in source.model_names()}
    problems = mismatch_report(model_shapes(model), found)
    if problems:
        raise CheckpointError(
            f"initial weights {path} do not fit this model ({len(problems)} difference(s)):\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nUse weights of this model shape, or change the model config to match them."
        )
    inner = getattr(model, "module", model)
    fill_parameters(inner, lambda name, param: source.get(MODEL_PREFIX + name).to(param.dtype))


def inspect_report(path: str | Path) -> str:
    """A readable summary: run facts (DCP), then every tensor, then totals."""
    source = open_tensors(path)
    lines = [f"{source.path} ({source.kind})"]
    for key in (
        "step",
        "world_size",
        "strategy",
        "model_class",
        "model_config_hash",
        "freetx_version",
    ):
        if key in source.meta:
            lines.append(f"  {key}: {source.meta[key]}")
    if source.model_config:
        lines.append(f"  model_config: {json.dumps(source.model_config)}")
    rows = [("TENSOR", "SHAPE", "DTYPE", "BYTES")]
    totals: dict[str, int] = {}
    for name, info in source.infos.items():
        rows.append(
            (
                name,
                str(list(info.shape)),
                str(info.dtype).removeprefix("torch."),
                f"{info.nbytes:,}",
            )
        )
        group = name.split(".", 1)[0]
        totals[group] = totals.get(group, 0) + info.nbytes
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append("totals:")
    for group, size in totals.items():
        count = sum(1 for n in source.infos if n.split(".", 1)[0] == group)
        lines.append(f"  {group}: {count} tensors, {size:,} bytes ({size / 2**20:.1f} MiB)")
    if source.extras:
        lines.append(f"  other entries (not tensors): {', '.join(sorted(source.extras))}")
    return "\n".join(lines)


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

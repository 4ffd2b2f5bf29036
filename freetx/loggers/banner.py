"""The start-up banner every training recipe prints on rank 0."""

from __future__ import annotations

from freetx.loggers.loggers import format_value


def training_banner(
    recipe: str, runtime, shape, cfg, model: str | None = None, weights: str | None = None, **facts
) -> str:
    """`recipe | world size | strategy and axes | device (backend) | precision | batch
    split | model: what it is | weights: where they come from | facts`.

    `shape` is the run's `MeshShape` (its strategy, the degree of each axis); `cfg` the
    run's config (batch_size, gradient_accumulation_steps, distributed.mixed_precision);
    `model`: the model's own words for what it is ("native freetx decoder for qwen3"),
    where it says; `weights`: where its weights come from ("random init (seed 0)", "DIR
    (HF safetensors)", "resumed from CHECKPOINT"); `facts` are the recipe's own (numbers are formatted with thousands
    separators).
    """
    mp = cfg.distributed.mixed_precision
    accumulation = cfg.gradient_accumulation_steps
    micro = cfg.batch_size // (shape.dp * accumulation)
    pipelined = " micro-batches through the stages" if shape.pp > 1 else " accumulation"
    parts = [
        recipe,
        f"world size {runtime.world_size}",
        f"strategy {shape.strategy}{shape.grid()}",
        f"device {runtime.device} ({runtime.backend})",
        f"precision param {mp.param_dtype}, reduce {mp.reduce_dtype}",
        f"batch {cfg.batch_size} = {shape.dp} {'data-parallel ' if shape.has_axes else ''}"
        f"rank(s) x {micro} x {accumulation}{pipelined}",
    ]
    if model is not None:
        parts.append(f"model: {model}")
    if weights is not None:
        parts.append(f"weights: {weights}")
    parts += [
        f"{name.replace('_', ' ')} {format_value(value)}"
        for name, value in facts.items()
        if value is not None  # a fact the run does not have
    ]
    return " | ".join(parts)

"""The start-up banner every training recipe prints on rank 0."""

from __future__ import annotations

from freetx.loggers.loggers import format_value


def training_banner(
    recipe: str, runtime, strategy: str, cfg, model: str | None = None, **facts
) -> str:
    """`recipe | world size | strategy | device (backend) | precision | batch split |
    model: what it is | facts`.

    `cfg` is the run's config (batch_size, gradient_accumulation_steps,
    distributed.mixed_precision); `model`: the model's own words for what it is
    ("native freetx decoder for qwen3"), where it says; `facts` are the recipe's own
    (numbers are formatted with thousands separators).
    """
    mp = cfg.distributed.mixed_precision
    accumulation = cfg.gradient_accumulation_steps
    dist = cfg.distributed
    names = {"pp": "pipeline", "cp": "context parallel", "tp": "tensor parallel"}
    axes = {"pp": dist.pp, "cp": dist.cp, "tp": dist.tp}  # ranks that read the same data
    inner = axes["pp"] * axes["cp"] * axes["tp"]
    data_ranks = runtime.world_size // inner
    micro = cfg.batch_size // (data_ranks * accumulation)
    grid = "".join(f" x {names[a]} {n}" for a, n in axes.items() if n > 1)
    pipelined = " micro-batches through the stages" if axes["pp"] > 1 else " accumulation"
    parts = [
        recipe,
        f"world size {runtime.world_size}",
        f"strategy {strategy}{grid}",
        f"device {runtime.device} ({runtime.backend})",
        f"precision param {mp.param_dtype}, reduce {mp.reduce_dtype}",
        f"batch {cfg.batch_size} = {data_ranks} {'data-parallel ' if inner > 1 else ''}rank(s) x "
        f"{micro} x {accumulation}{pipelined}",
    ]
    if model is not None:
        parts.append(f"model: {model}")
    parts += [
        f"{name.replace('_', ' ')} {format_value(value)}"
        for name, value in facts.items()
        if value is not None  # a fact the run does not have
    ]
    return " | ".join(parts)

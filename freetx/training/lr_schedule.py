"""Learning-rate schedules: linear warmup, then cosine, linear or constant."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from freetx.fields import at_least


@dataclass
class LRScheduleConfig:
    """The `lr_schedule:` section: warmup steps, then decay to min_lr_ratio * lr."""

    warmup_steps: int = at_least(0, default=0)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.1
    # the share of the steps after warmup over which the decay happens, at the end;
    # the lr is constant before (0.2: the last 20%, as crosscoder trainers do)
    decay_fraction: float = 1.0

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """Schedules that are no decay (freetx.fields: checked by `freetx validate` and
        before every run), by key: why, and the fix."""
        found = {}
        if not 0 <= values.get("min_lr_ratio", 0.1) <= 1:
            found["min_lr_ratio"] = (
                "the lr decays to min_lr_ratio x lr, so a ratio above 1 raises it and one below "
                "0 makes it negative; set it in [0, 1] (e.g. 0.1)."
            )
        if not 0 < values.get("decay_fraction", 1.0) <= 1:
            found["decay_fraction"] = (
                "it is the share of the steps after warmup over which the lr decays; set it in "
                "(0, 1] (1.0: all of them)."
            )
        return found


def lr_multiplier(step: int, total_steps: int, cfg: LRScheduleConfig) -> float:
    """The factor on the base lr for the update made at `step` (0-based)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    span = max(1, round((total_steps - cfg.warmup_steps) * cfg.decay_fraction))
    progress = min(1.0, max(0.0, step - (total_steps - span)) / span)
    if cfg.decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_lr_scheduler(optimizer: Optimizer, total_steps: int, cfg: LRScheduleConfig) -> LambdaLR:
    """A LambdaLR (a Stateful: it goes into checkpoints) following `lr_multiplier`."""
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, cfg))

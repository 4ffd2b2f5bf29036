"""`freetx estimate --ladder`: a config's estimate for its own strategy with the memory
ladder's rungs switched on one after another (`LADDER`), from a baseline with every rung
off: no activation checkpointing, the loss's logits at once (num_chunks 1), fp32 AdamW,
nothing offloaded, no float8. Each rung is counted as freetx/planning/estimate.py says;
a rung a run of this config would refuse is said, and left off the rungs after it."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from freetx.config.instantiate import COMPONENT
from freetx.distributed.mesh import canonical_strategy
from freetx.errors import ConfigError
from freetx.planning.config import estimate_config
from freetx.planning.estimate import DEVICES, Estimate

ADAMW = "torch.optim.AdamW"
ADAMW_8BIT = "torchao.optim.AdamW8bit"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the ladder sets, rung by rung (the baseline: all off)."""

    checkpointing: str = "none"
    chunked: bool = False
    optimizer: str = ADAMW
    in_backward: bool = False
    offload: bool = False
    activation_offloading: bool = False
    float8: str = "none"

    def config(self, cfg: Any) -> Any:
        """`cfg` with these settings (in_backward: without gradient clipping, which it
        cannot combine with)."""
        node: dict[str, Any] = {COMPONENT: self.optimizer}
        if self.in_backward:
            node["in_backward"] = True
        if self.offload:
            node["offload"] = "cpu"
        dist = dataclasses.replace(
            cfg.distributed,
            activation_checkpointing=self.checkpointing,
            activation_offloading=self.activation_offloading,
            float8=self.float8,
        )
        clip = None if self.in_backward else cfg.max_grad_norm
        return dataclasses.replace(cfg, distributed=dist, optimizer=node, max_grad_norm=clip)


# (the row's name, what its rung changes of the settings before it)
LADDER = (
    ("baseline", {}),
    ("+ activation checkpointing (full)", {"checkpointing": "full"}),
    ("+ chunked loss", {"chunked": True}),
    ("+ 8-bit AdamW", {"optimizer": ADAMW_8BIT}),
    ("+ optimizer in backward", {"in_backward": True}),
    ("+ optimizer offload (instead of in backward)", {"in_backward": False, "offload": True}),
    ("+ activation offloading", {"activation_offloading": True}),
    ("+ float8", {"float8": "tensorwise"}),
)


class Rung(NamedTuple):
    """A row of the ladder: its estimate for the config's strategy, or why not."""

    name: str
    row: Estimate | None
    refused: str = ""


def ladder(
    cfg: Any, world_size: int, device: str, mfu: float = 0.4, replicas: int = 1
) -> list[Rung]:
    """The ladder's rows for `cfg`'s strategy at `world_size` ranks of `device`; float8's
    only on a device with float8 matmuls (it is the config's recipe if it names one)."""
    strategy = canonical_strategy(cfg.distributed.strategy)
    settings, rungs = Settings(), []
    for name, change in LADDER:
        if "float8" in change:
            if DEVICES[device].float8_peak is None:
                continue
            float8 = cfg.distributed.float8
            change = {"float8": float8 if float8 != "none" else change["float8"]}
        tried = dataclasses.replace(settings, **change)
        try:
            found = estimate_config(
                tried.config(cfg), world_size, device, mfu, replicas, chunked=tried.chunked
            )
        except ConfigError as e:
            rungs.append(Rung(name, None, e.problems[0]))
            continue
        row = next((r for r in found.rows if r.strategy == strategy), None)
        if row is None:
            rungs.append(Rung(name, None, found.refused.get(strategy, "")))
            continue
        settings = tried
        rungs.append(Rung(name, row))
    return rungs

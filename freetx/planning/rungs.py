"""The memory ladder's rungs as `freetx estimate` counts them (`Rungs`, read from a config
by `Rungs.of`): the optimizer's states per trainable element by its class
(`STATE_FORMATS`), the `optimizer:` node's rungs (freetx.distributed.optimizer: offload,
in_backward, state_dtype) and the `distributed:` section's (activation_offloading,
float8). Activation checkpointing and the chunked loss are `estimate`'s arguments.

Bytes of optimizer state per trainable element (torchao 0.18's block sizes):

    | class                                      | states        | + per block of   |
    | torch.optim.Adam, AdamW (and NAdam ...)    | 2 x fp32 = 8  |                  |
    |   with optimizer.state_dtype: bfloat16     | 2 x bf16 = 4  |                  |
    | torchao.optim.AdamW8bit, Adam8bit          | 2 x 1 = 2     | 256: 2 fp32 scales |
    | torchao.optim.AdamW4bit, Adam4bit          | 2 x 0.5 = 1   | 128: 2 fp32 scales |
    | torchao.optim.AdamWFp8, AdamFp8            | 2 x 1 = 2     | 256: 2 fp32 scales |
    | torch.optim.SGD with momentum / without    | 4 / 0         |                  |

torchao quantizes a parameter (shard) of at least 4096 elements that its block size
divides, with a lookup table per state (256 fp32 entries at 8 bits, 16 at 4 bits), and
keeps the others' states in fp32, as `StateFormat.bytes` counts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from freetx.config.instantiate import COMPONENT
from freetx.distributed.optimizer import OptimizerOptions
from freetx.errors import ConfigError

QUANTIZED_FROM = 4096  # torchao's (and bitsandbytes'): smaller tensors keep fp32 states


@dataclass(frozen=True)
class StateFormat:
    """An optimizer's states of one parameter: `states` tensors of its shape, `bits` per
    element; quantized ones (`block` > 0) with an fp32 scale per `block` elements and a
    lookup table of `table` fp32 entries per tensor."""

    states: int
    bits: float = 32
    block: int = 0
    table: int = 0

    def bytes(self, numel: float) -> float:
        """Bytes of the states of a parameter (or this rank's shard of it) of `numel`
        elements."""
        if not self.block:
            return self.states * numel * self.bits / 8
        if numel < QUANTIZED_FROM or numel % self.block:  # torchao keeps it in fp32
            return self.states * numel * 4
        return self.states * (numel * self.bits / 8 + numel / self.block * 4 + self.table * 4)


ADAMW = StateFormat(2)
# optimizer class (its package, its name) -> its states; SGD's depends on its momentum
STATE_FORMATS = {
    **{
        ("torch", name): ADAMW for name in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adadelta")
    },
    ("torch", "Adagrad"): StateFormat(1),
    ("torch", "RMSprop"): StateFormat(1),  # its square average; + momentum, + centered
    ("torch", "SGD"): StateFormat(0),  # + momentum
    **{("torchao", name): StateFormat(2, 8, 256, 256) for name in ("AdamW8bit", "Adam8bit")},
    **{("torchao", name): StateFormat(2, 4, 128, 16) for name in ("AdamW4bit", "Adam4bit")},
    **{("torchao", name): StateFormat(2, 8, 256) for name in ("AdamWFp8", "AdamFp8")},
}


def state_format(node: Any) -> StateFormat:
    """The states an `optimizer:` node's class keeps per parameter (`STATE_FORMATS`), with
    its arguments that add one (momentum, amsgrad, centered), its torchao block size and
    `optimizer.state_dtype`; a class the table lacks is refused."""
    target = str(node.get(COMPONENT, ""))
    found = STATE_FORMATS.get((target.split(".")[0], target.rpartition(".")[2]))
    if found is None:
        known = sorted({f"{package}.optim.{name}" for package, name in STATE_FORMATS})
        raise ConfigError(
            f"freetx estimate counts the optimizer states of {', '.join(known)}; "
            f"optimizer._component_={target} is none of them.",
            fix="Estimate with optimizer._component_=torch.optim.AdamW (two fp32 states per "
            "trained element, as many as most optimizers keep or more), then run with yours.",
        )
    extra = sum(bool(node.get(key, False)) for key in ("momentum", "amsgrad", "centered"))
    block = int(node.get("block_size", found.block)) if found.block else 0
    state_dtype = OptimizerOptions.of(node).state_dtype
    bits = 16 if state_dtype == "bfloat16" and not found.block else found.bits
    return StateFormat(found.states + extra, bits, block, found.table)


@dataclass(frozen=True)
class Rungs:
    """The rungs a run takes that the estimate counts besides activation checkpointing and
    the chunked loss (freetx/planning/estimate.py says how):

    `states`: the optimizer's (`state_format`); `optimizer_offload`: optimizer.offload=cpu;
    `in_backward`: optimizer.in_backward; `activation_offloading`, `float8`: the
    `distributed:` keys; `accumulation`: gradient_accumulation_steps (on one process the
    offloaded optimizer copies the gradients at a step's last micro-batch only)."""

    states: StateFormat = ADAMW
    optimizer_offload: bool = False
    in_backward: bool = False
    activation_offloading: bool = False
    float8: str = "none"
    accumulation: int = 1

    @classmethod
    def of(cls, cfg: Any) -> Rungs:
        """A training config's rungs (its `optimizer:` node and `distributed:` section)."""
        options = OptimizerOptions.of(cfg.optimizer)
        dist = cfg.distributed
        return cls(
            state_format(cfg.optimizer),
            options.offload == "cpu",
            options.in_backward,
            dist.activation_offloading,
            dist.float8,
            cfg.gradient_accumulation_steps,
        )

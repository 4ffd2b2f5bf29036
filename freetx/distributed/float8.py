"""float8 training (`distributed.float8`): the blocks' Linears swapped for torchao's
`Float8Linear`, whose matmuls run in float8 with dynamic scales (torchao.float8).

- tensorwise: one scale per tensor (cuBLAS's float8 kernel, the fastest). Under FSDP2
  the weights are cast to float8 before their all-gather (half of bf16's bytes), and
  their scales computed for all of them in one all-reduce after each optimizer step
  (`precompute_float8_scales`); not with `cpu_offload` (the shards live on the CPU).
- rowwise: one scale per row (CUTLASS's kernel; closer to bf16); weights all-gathered
  in the parameter dtype.

The order follows torchtitan: the conversion before activation checkpointing, compile
and FSDP2 (`parallelize`). Converted: exactly `nn.Linear` (an adapter's subclass and the
Linears inside it, LoRA's A and B, stay), inside the model's blocks (the embedding and
the output head stay: the head's logits need the precision), not among the modules the
model always trains, with both dimensions divisible by 16 (float8 matmuls' tiles).
float8 matmuls need CUDA capability 8.9 or later (H100, L4, RTX 4090): refused on the
CPU by `check_float8`, and on an older GPU at run start by `check_float8_device`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from freetx.errors import ConfigError
from freetx.models.protocol import AlwaysTrained, HasBlocks

FLOAT8_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (sm_89) and Hopper (sm_90) onward
TILE = 16  # float8 matmuls need both dimensions divisible by this


def check_float8(recipe: str, tp: int, device_type: str | None) -> None:
    """`distributed.float8` refusals known before launch (with `check_distributed`)."""
    if recipe == "none":
        return
    if device_type == "cpu":
        raise ConfigError(
            f"distributed.float8={recipe}: float8 matmuls need an H100-class GPU (CUDA "
            "capability 8.9+), and this run is on the CPU.",
            fix="Set distributed.float8=none (or run on an H100, H200, L4 or later GPU).",
        )
    if tp > 1:
        raise ConfigError(
            f"distributed.float8={recipe} with distributed.tp={tp}: freetx slices the "
            "blocks' Linears by tensor parallelism as plain Linears, not with torchao's "
            "float8 tensor-parallel styles.",
            fix="Set distributed.tp=1 (shard with fsdp instead), or distributed.float8=none.",
        )


def check_float8_device(recipe: str, device: torch.device) -> None:
    """At run start on CUDA: the GPU has float8 tensor cores (capability 8.9+)."""
    if recipe == "none" or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FLOAT8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"distributed.float8={recipe}: the {name} (CUDA capability "
            f"{capability[0]}.{capability[1]}) has no float8 matmuls; they need capability "
            "8.9+ (H100, H200, L4, RTX 4090 or later).",
            fix="Set distributed.float8=none (bfloat16 mixed precision trains on this GPU).",
        )


def float8_filter(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """Which of `model`'s Linears (module, qualified name) float8 converts (the module
    docstring's rule)."""
    types = tuple(model.block_types or ()) if isinstance(model, HasBlocks) else ()
    in_blocks = {
        id(m)
        for block in model.modules()
        if types and isinstance(block, types)
        for m in block.modules()
    }
    inside_adapters = {
        id(m)
        for outer in model.modules()
        if type(outer) is not nn.Linear and isinstance(outer, nn.Linear)
        for m in outer.modules()
    }
    always = model.always_trained if isinstance(model, AlwaysTrained) else ()

    def converts(module: nn.Module, name: str) -> bool:
        return (
            type(module) is nn.Linear
            and id(module) not in inside_adapters
            and (not types or id(module) in in_blocks)
            and not any(name == a or name.startswith(f"{a}.") for a in always)
            and module.in_features % TILE == 0
            and module.out_features % TILE == 0
        )

    return converts


def convert_to_float8(model: nn.Module, recipe: str, float8_all_gather: bool) -> None:
    """Swap `model`'s Linears that `float8_filter` picks for torchao's Float8Linear, in
    place (on the meta device too), with `recipe`'s scaling; `float8_all_gather`
    (tensorwise under FSDP2): weights cast to float8 before FSDP2 gathers them."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if float8_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, module_filter_fn=float8_filter(model), config=config)


def precompute_float8_scales(model: nn.Module) -> None:
    """The float8 scales of the sharded weights for the next all-gather, computed for all
    of them in one all-reduce (after each optimizer step, with float8 all-gather)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)

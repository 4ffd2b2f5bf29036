"""FSDP keys read as freetx overrides: the seeds' FSDP files (`freetx import fsdp-config`:
a flat JSON of fsdp_* keys, or a YAML with `distributed:` and `training:` sections) and
accelerate's fsdp_config section (freetx.planning.accelerate_import), each fsdp_* key to
its strategy, offload, precision or checkpointing; every other key listed with why."""

from __future__ import annotations

from typing import Any

from freetx.distributed.config import (
    FSDP_SHARDING_STRATEGIES,
    RESHARD_AFTER_FORWARD_STRATEGIES,
)
from freetx.planning.imported_config import (
    ALWAYS,
    BLOCKS,
    SHARDED_SAVES,
    ImportedConfig,
    _flag,
    _flatten,
    _pop,
    _seed_key,
    set_batch,
    set_dtype,
    set_precision,
)

# keys with no freetx equivalent, and why
FSDP_UNMAPPED = {
    "fsdp_transformer_layer_cls_to_wrap": BLOCKS,
    "fsdp_min_num_params": BLOCKS,
    "fsdp_state_dict_type": SHARDED_SAVES,
    "fsdp_backward_prefetch": "FSDP2 prefetches the next block in backward; no knob",
    "fsdp_backward_prefetch_policy": "FSDP2 prefetches the next block in backward; no knob",
    "fsdp_forward_prefetch": "FSDP2 prefetches the next block in forward; no knob",
    "fsdp_cpu_ram_efficient_loading": ALWAYS,
    "fsdp_sync_module_states": ALWAYS,
    "fsdp_use_orig_params": "FSDP2 always keeps the original parameters (as DTensors)",
    "fsdp_buffer_dtype": "buffers (RoPE tables) stay float32",
    "fsdp_cuda_graphs": "no CUDA graphs in freetx; distributed.compile=true compiles blocks",
    "fsdp_version": "freetx is FSDP2 (fully_shard) throughout",
}


def _fsdp_key(found: ImportedConfig, key: str, name: str, value: Any) -> bool:
    """One fsdp_* key (`name`, under `key` in the file); False when it is no FSDP key."""
    if name == "use_fsdp":
        if value is True:
            found.overrides.setdefault(
                "distributed.strategy", FSDP_SHARDING_STRATEGIES["FULL_SHARD"]
            )
    elif name == "fsdp_sharding_strategy":
        strategy = FSDP_SHARDING_STRATEGIES.get(str(value).upper())
        if strategy is None:
            found.skip(
                key,
                f"{value!r}: freetx has FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and "
                "HYBRID_SHARD (its replica count: distributed.replicate_degree)",
            )
        else:
            found.set("distributed.strategy", strategy)
    elif name == "fsdp_reshard_after_forward":
        found.set(
            "distributed.strategy", RESHARD_AFTER_FORWARD_STRATEGIES[_flag(found, key, value)]
        )
    elif name in ("fsdp_offload_params", "fsdp_cpu_offload"):
        found.set("distributed.cpu_offload", _flag(found, key, value))
    elif name == "fsdp_activation_checkpointing":
        checkpointing = _flag(found, key, value)
        found.set("distributed.activation_checkpointing", "full" if checkpointing else "none")
    elif name == "fsdp_mixed_precision":
        set_precision(found, key, value)
    elif name == "fsdp_param_dtype":
        set_dtype(found, key, "param_dtype", value)
    elif name == "fsdp_reduce_dtype":
        set_dtype(found, key, "reduce_dtype", value)
    elif name == "fsdp_auto_wrap_policy":
        if str(value).upper() not in ("TRANSFORMER_BASED_WRAP", "TRANSFORMER_AUTO_WRAP"):
            found.skip(key, f"{value!r}: {BLOCKS}; no size-based or whole-model wrapping")
        # else: what freetx does anyway
    elif name in FSDP_UNMAPPED:
        found.skip(key, FSDP_UNMAPPED[name])
    else:
        return False
    return True


def import_fsdp_config(found: ImportedConfig, data: dict, world_size: int | None) -> None:
    """The seeds' FSDP files: a flat JSON of fsdp_* keys, or a YAML whose `distributed:`
    holds them and whose `training:` holds batch size, precision and checkpointing."""
    flat = _flatten(data)
    per_gpu = ("batch_size", "micro_batch_size", "train_batch_size")  # the seeds' names
    micro = _pop(flat, *per_gpu, *(f"training.{name}" for name in per_gpu))
    sections = ("", "training.", "distributed.")
    steps = _pop(flat, *(f"{section}gradient_accumulation_steps" for section in sections))
    set_batch(found, micro, steps, world_size)
    for key, value in flat.items():
        name = key.rsplit(".", 1)[-1]
        if _fsdp_key(found, key, name, value):
            continue
        if name in ("bf16", "fp16"):
            if value is True:
                set_precision(found, key, name)
        elif name == "mixed_precision":
            set_precision(found, key, value)
        elif name == "gradient_checkpointing":
            found.set("distributed.activation_checkpointing", "full" if value else "none")
        elif not _seed_key(found, key, name, value):
            found.skip(key, "not a key freetx maps")

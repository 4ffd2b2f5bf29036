"""A DeepSpeed JSON (ds_config.json) read as freetx overrides (`freetx import deepspeed`):
the ZeRO stage as a strategy, offload, precision, batch sizes (DeepSpeed's
train_batch_size is global, as freetx's), the optimizer and its schedule, clipping; every
other key listed with why."""

from __future__ import annotations

from typing import Any

from freetx.distributed.config import ZERO_STAGE_STRATEGIES
from freetx.planning.imported_config import (
    AUTO,
    BLOCKS,
    COUNT,
    RATE,
    SHARDED_SAVES,
    STEPS,
    ImportedConfig,
    _flag,
    _flatten,
    _is_auto,
    _number,
    _pop,
    _seed_key,
    bad_value,
    set_batch,
    set_betas,
    set_clipping,
    set_dtype,
    set_number,
    set_offload,
    set_precision,
)

BUCKETS = "FSDP2 communicates one block at a time (the block is the bucket); no bucket knob"
OPTIMIZERS = {"adam": "torch.optim.Adam", "adamw": "torch.optim.AdamW", "sgd": "torch.optim.SGD"}
# DeepSpeed's schedules: the decay, and the lr it ends at (a ratio of the peak):
# WarmupDecayLR decays linearly to 0, WarmupCosineLR to cos_min_ratio (0.0001 by default)
SCHEDULE_DECAYS = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
SCHEDULE_MIN_LR_RATIOS = {"WarmupDecayLR": 0.0, "WarmupCosineLR": 0.0001}
AUTO_PRECISION = (
    "auto: the HF Trainer turns it on from its own --bf16 / --fp16 arguments, which this file "
    "does not hold, so no precision is imported and the recipe's config decides "
    "(distributed.mixed_precision.param_dtype; set it to bfloat16 for the Trainer's --bf16)"
)

# what a key must be when its value is of another type: DeepSpeed's sections, and its names
MAPPING = (dict, "a mapping of keys to values (a JSON object)")
EXPECTED: dict[str, tuple[type, str]] = {
    "optimizer": MAPPING,
    "optimizer.params": MAPPING,
    "scheduler": MAPPING,
    "scheduler.params": MAPPING,
    "zero_optimization": MAPPING,
    "zero_optimization.offload_optimizer": MAPPING,
    "zero_optimization.offload_param": MAPPING,
    "bf16": MAPPING,
    "fp16": MAPPING,
    "compile": MAPPING,
    "optimizer.type": (str, "an optimizer's name (Adam, AdamW or SGD)"),
    "scheduler.type": (str, f"a scheduler's name ({', '.join(SCHEDULE_DECAYS)})"),
}

# keys with no freetx equivalent, and why
DEEPSPEED_UNMAPPED = {
    "zero_optimization.contiguous_gradients": "FSDP2 keeps each block's gradients in one flat "
    "buffer for its reduce-scatter; no knob",
    "zero_optimization.overlap_comm": "FSDP2 and DDP always overlap communication with compute",
    "zero_optimization.reduce_scatter": "sharded strategies always reduce-scatter gradients",
    "zero_optimization.reduce_bucket_size": BUCKETS,
    "zero_optimization.allgather_bucket_size": BUCKETS,
    "zero_optimization.allgather_partitions": BUCKETS,
    "zero_optimization.stage3_prefetch_bucket_size": "FSDP2 prefetches the next block; no knob",
    "zero_optimization.stage3_param_persistence_threshold": BLOCKS,
    "zero_optimization.stage3_max_live_parameters": BLOCKS,
    "zero_optimization.stage3_max_reuse_distance": BLOCKS,
    "zero_optimization.sub_group_size": BLOCKS,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": SHARDED_SAVES,
    "zero_optimization.round_robin_gradients": "a ZeRO-2 offload optimization of DeepSpeed's own",
    "zero_optimization.offload_optimizer.pin_memory": "freetx's offloaded optimizer pins its "
    "host copies on CUDA always",
    "zero_optimization.offload_param.pin_memory": "FSDP2's CPUOffloadPolicy pins memory always",
    "zero_allow_untested_optimizer": "freetx's strategies work with any torch optimizer",
    "zero_force_ds_cpu_optimizer": "freetx uses the torch optimizer the config names",
    "fp16.loss_scale": "freetx's float16 uses torch.amp.GradScaler's dynamic scaling",
    "fp16.initial_scale_power": "freetx's float16 uses torch.amp.GradScaler's defaults",
    "fp16.loss_scale_window": "freetx's float16 uses torch.amp.GradScaler's defaults",
    "fp16.hysteresis": "freetx's float16 uses torch.amp.GradScaler's defaults",
    "fp16.min_loss_scale": "freetx's float16 uses torch.amp.GradScaler's defaults",
    "prescale_gradients": "freetx divides every loss by the global count of units once",
    "gradient_predivide_factor": "freetx divides every loss by the global count of units once",
    "wall_clock_breakdown": "use profiler.enabled=true for a torch.profiler trace",
    "flops_profiler": "freetx logs MFU every log_every_n_steps; `freetx estimate` predicts it",
    "activation_checkpointing": "DeepSpeed's section only tunes checkpointing the model code "
    "enables; freetx's switch is distributed.activation_checkpointing=full|selective",
    "tensorboard": "freetx's configs log to TensorBoard through metric_loggers",
    "wandb": "add freetx's WandB logger to metric_loggers",
    "csv_monitor": "freetx writes metrics.jsonl in output_dir",
    "amp": "NVIDIA apex AMP: use distributed.mixed_precision instead",
}


def import_deepspeed(found: ImportedConfig, data: dict, world_size: int | None) -> None:
    """A DeepSpeed JSON's keys into `found` (`world_size`: the GPUs, for per-GPU batches)."""
    flat = _flatten(data)
    for key, (kind, expected) in EXPECTED.items():
        value = flat.get(key)
        if value is not None and not isinstance(value, kind):
            raise bad_value(found, key, value, expected)
    total = _pop(flat, "train_batch_size")
    micro = _pop(flat, "train_micro_batch_size_per_gpu")
    accumulation = _pop(flat, "gradient_accumulation_steps")
    if total is not None and not _is_auto(total[1]):
        micro = None  # DeepSpeed's train_batch_size is global already, as freetx's
        batch = _number(found, *total)
        if batch is not None:
            found.set("batch_size", int(batch))
    elif total is not None:
        found.skip(total[0], AUTO)
    set_batch(found, micro, accumulation, world_size)
    optimizer_type = flat.pop("optimizer.type", None)
    scheduler_type = flat.pop("scheduler.type", None)
    if optimizer_type is not None:
        component = OPTIMIZERS.get(optimizer_type.lower())
        if component is None:
            found.skip(
                "optimizer.type",
                f"{optimizer_type!r}: name a torch optimizer in optimizer._component_ "
                "(torch.optim.AdamW, torchao's 8-bit AdamW)",
            )
        else:
            found.set("optimizer._component_", component)
    if scheduler_type is not None and scheduler_type not in SCHEDULE_DECAYS:
        found.skip(
            "scheduler.type",
            f"{scheduler_type!r}: freetx's lr_schedule is warmup, then cosine, linear or "
            "constant decay",
        )
    elif scheduler_type is not None:
        found.set("lr_schedule.decay", SCHEDULE_DECAYS[scheduler_type])
        if scheduler_type in SCHEDULE_MIN_LR_RATIOS:
            ratio = flat.pop("scheduler.params.cos_min_ratio", None)
            ratio = SCHEDULE_MIN_LR_RATIOS[scheduler_type] if ratio is None else ratio
            found.set(
                "lr_schedule.min_lr_ratio",
                _number(found, "scheduler.params.cos_min_ratio", ratio, (False, 0.0, 1.0)),
            )
    for key, value in flat.items():
        _deepspeed_key(found, key, value)


def _deepspeed_key(found: ImportedConfig, key: str, value: Any) -> None:
    section = key.split(".")[0]
    if key == "zero_optimization.stage":
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value not in ZERO_STAGE_STRATEGIES
        ):
            raise bad_value(found, key, value, "a ZeRO stage: 0, 1, 2 or 3")
        found.set("distributed.strategy", ZERO_STAGE_STRATEGIES[value])
    elif key in (
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.offload_param.device",
    ):
        set_offload(found, key, value)
    elif key in ("bf16.enabled", "fp16.enabled"):
        if _is_auto(value):
            found.skip(key, AUTO_PRECISION)
        elif value is True:
            set_precision(found, key, section)
        elif value is not False:
            raise bad_value(found, key, value, 'true, false or "auto"')
    elif key == "communication_data_type":
        set_dtype(found, key, "reduce_dtype", value)
    elif key == "gradient_clipping":
        set_clipping(found, key, value)
    elif key in ("optimizer.params.lr", "scheduler.params.warmup_max_lr"):
        set_number(found, key, value, "optimizer.lr", RATE)
    elif key in ("optimizer.params.weight_decay", "optimizer.params.eps"):
        set_number(found, key, value, f"optimizer.{key.rsplit('.', 1)[1]}", RATE)
    elif key == "optimizer.params.betas":
        set_betas(found, key, value)
    elif key == "scheduler.params.warmup_num_steps":
        set_number(found, key, value, "lr_schedule.warmup_steps", STEPS)
    elif key == "scheduler.params.total_num_steps":
        set_number(found, key, value, "max_steps", (True, 1, 10**12))
    elif key == "steps_per_print":
        set_number(found, key, value, "log_every_n_steps", COUNT)
    elif key == "compile.enabled":
        found.set("distributed.compile", _flag(found, key, value))
    elif key in DEEPSPEED_UNMAPPED or section in DEEPSPEED_UNMAPPED:
        found.skip(key, DEEPSPEED_UNMAPPED.get(key) or DEEPSPEED_UNMAPPED[section])
    elif key.startswith(("optimizer.params.", "scheduler.params.")):
        found.skip(key, "no freetx equivalent of this optimizer / scheduler parameter")
    elif not _seed_key(found, key, key.rsplit(".", 1)[-1], value):
        found.skip(key, "not a DeepSpeed key freetx maps")

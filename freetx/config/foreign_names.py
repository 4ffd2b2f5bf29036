"""The names migrating users bring: torchtune's recipe keys, the seeds' and the HF
Trainer's, DeepSpeed's batch sizes, each with the freetx key it means and how.

One table serves every place such a name is met: a config's unknown-key hint
(`freetx validate`, a run), an override written as an option (`--batch_size 256`),
and `freetx import`'s list of what it mapped and what has no equivalent.

    foreign_hint("epochs")                  # "did you mean 'max_steps'? freetx counts ..."
    foreign_hint("train_batch_size", 8)     # the global batch_size, with 8 multiplied out
"""

from __future__ import annotations

from typing import Any

# per-device batch names: freetx's batch_size is global
PER_DEVICE_BATCH_NAMES = (
    "train_batch_size",
    "micro_batch_size",
    "per_device_train_batch_size",
    "train_micro_batch_size_per_gpu",
    "batch_size_per_gpu",
)
GLOBAL_BATCH = (
    "freetx's batch_size is global: samples per optimizer step over all ranks = the "
    "per-device batch x the world size (processes) x gradient_accumulation_steps (freetx "
    "splits batch_size into that many micro-batches per rank)"
)

# name -> (the freetx key it means, how); None: no freetx key, only the why
FOREIGN_KEYS: dict[str, tuple[str | None, str]] = {
    # torchtune's recipe configs
    "epochs": (
        "max_steps",
        "freetx counts optimizer steps, not epochs: max_steps = epochs x ceil(training samples / "
        "batch_size) (`freetx import torchtune CONFIG --dataset-size N` computes it)",
    ),
    "max_steps_per_epoch": ("max_steps", "freetx has no epochs; max_steps caps the run"),
    "dtype": (
        "distributed.mixed_precision.param_dtype",
        "torchtune's dtype is the compute dtype: bf16 -> "
        "distributed.mixed_precision.param_dtype=bfloat16 (gradients are reduced in "
        "distributed.mixed_precision.reduce_dtype, float32 by default)",
    ),
    "resume_from_checkpoint": (
        "resume",
        "resume=auto (the default) continues from the newest checkpoint in output_dir; "
        "resume=never starts afresh; resume=PATH from that checkpoint",
    ),
    "checkpointer": (
        "model_dir",
        "torchtune's checkpointer.checkpoint_dir is freetx's model_dir (an HF folder; "
        "checkpoint.initial_weights=${model_dir} loads it), its output_dir is output_dir; freetx "
        "saves DCP checkpoints and `freetx checkpoint convert` writes HF folders",
    ),
    "lr_scheduler": (
        "lr_schedule",
        "freetx's schedule is lr_schedule.warmup_steps, then lr_schedule.decay (cosine, linear or "
        "constant) to lr_schedule.min_lr_ratio x the peak",
    ),
    "enable_activation_checkpointing": (
        "distributed.activation_checkpointing",
        "true -> full (or selective: every distributed.ac_every_n_blocks-th block)",
    ),
    "enable_activation_offloading": (
        "distributed.activation_offloading",
        "true moves saved activations to pinned host memory (with activation "
        "checkpointing: the blocks' inputs)",
    ),
    "compile": ("distributed.compile", "distributed.compile=true compiles each block"),
    "clip_grad_norm": ("max_grad_norm", "null turns clipping off"),
    "shuffle": (None, "freetx always shuffles the training samples (each epoch by the seed)"),
    "metric_logger": (
        "metric_loggers",
        "a list of logger nodes (progress bar, JSONL, TensorBoard, WandB)",
    ),
    "log_peak_memory_stats": (
        None,
        "freetx logs memory/peak_* every log_every_n_steps (CUDA); list them in the "
        "progress bar's keys",
    ),
    "fsdp_cpu_offload": (
        "distributed.cpu_offload",
        "true offloads parameters, gradients and the optimizer step (FSDP2's CPUOffloadPolicy)",
    ),
    "fsdp_reshard_after_forward": (
        "distributed.strategy",
        "true -> fsdp, false -> zero2 (blocks stay gathered from forward to backward)",
    ),
    "optimizer_in_bwd": (
        "optimizer.in_backward",
        "true steps each parameter in backward as its gradient is ready (no gradient "
        "accumulation, max_grad_norm=null)",
    ),
    "custom_sharded_layers": (
        None,
        "freetx shards every block, the embeddings and the output layer; no list to give",
    ),
    "save_adapter_weights_only": (
        None,
        "with peft.method=lora, checkpoints hold the adapters only; `freetx checkpoint convert "
        "--to peft` writes them",
    ),
    "low_cpu_ram": (None, "freetx builds on the meta device and each rank reads its shard"),
    "log_level": (None, "set FREETX_DEBUG=1 for tracebacks; freetx has no log level key"),
    "batch_size_val": ("eval.batch_size", "eval.batch_size is global, like batch_size"),
    "run_val_every_n_steps": ("eval.every_n_steps", ""),
    "dataset_val": ("dataset", "freetx holds out dataset.val_fraction of the dataset"),
    "data_parallel_replicate_dim": (
        "distributed.replicate_degree",
        "with distributed.strategy=hsdp",
    ),
    "tensor_parallel_dim": ("distributed.tp", ""),
    # the seeds' and the HF Trainer's names
    "num_epochs": (
        "max_steps",
        "freetx counts optimizer steps: max_steps = epochs x ceil(training samples / batch_size)",
    ),
    "learning_rate": ("optimizer.lr", ""),
    "lr": ("optimizer.lr", ""),
    "weight_decay": ("optimizer.weight_decay", ""),
    "warmup_steps": ("lr_schedule.warmup_steps", ""),
    "max_grad_norm": ("max_grad_norm", ""),
    "gradient_clip_norm": ("max_grad_norm", "null turns clipping off"),
    "gradient_clipping": ("max_grad_norm", "null turns clipping off"),
    "grad_clip": ("max_grad_norm", "null turns clipping off"),
    "dataloader_num_workers": ("num_workers", "data-loader workers per rank"),
    "gradient_checkpointing": ("distributed.activation_checkpointing", "true -> full"),
    "mixed_precision": ("distributed.mixed_precision.param_dtype", "bf16 -> bfloat16"),
    "bf16": ("distributed.mixed_precision.param_dtype", "true -> bfloat16"),
    "fp16": ("distributed.mixed_precision.param_dtype", "true -> float16"),
    "use_amp": ("distributed.mixed_precision.param_dtype", "bfloat16 or float16"),
    "use_deepspeed": (
        "distributed.strategy",
        "freetx has no DeepSpeed engine: ZeRO-1/2/3 are distributed.strategy=zero1|zero2|fsdp on "
        "FSDP2 (`freetx import deepspeed ds_config.json` maps the JSON)",
    ),
    **{name: ("batch_size", GLOBAL_BATCH) for name in PER_DEVICE_BATCH_NAMES},
    "batch_size": ("batch_size", GLOBAL_BATCH),  # per device in torchtune and the seeds
}


def foreign_key(name: str) -> str | None:
    """The freetx key another system's `name` means, if any."""
    entry = FOREIGN_KEYS.get(name)
    return entry[0] if entry else None


def foreign_why(name: str, value: Any = None, world_size: int | None = None) -> str | None:
    """How another system's `name` maps (or why it does not), with a per-device batch
    `value` multiplied out where the world size is known."""
    entry = FOREIGN_KEYS.get(name)
    if entry is None:
        return None
    why = entry[1]
    if name in PER_DEVICE_BATCH_NAMES or name == "batch_size":
        why = global_batch_note(value, world_size)
    return why


def global_batch_note(per_device: Any = None, world_size: int | None = None) -> str:
    """GLOBAL_BATCH, with a per-device `per_device` multiplied out (by `world_size`, or
    by example on 8 ranks)."""
    if not isinstance(per_device, int) or isinstance(per_device, bool) or per_device < 1:
        return GLOBAL_BATCH
    if world_size is not None:
        return (
            f"{GLOBAL_BATCH}: {per_device} per device on {world_size} ranks is "
            f"batch_size={per_device * world_size} x gradient_accumulation_steps"
        )
    return (
        f"{GLOBAL_BATCH}: {per_device} per device is batch_size={per_device} x N x "
        f"gradient_accumulation_steps on N ranks (batch_size={per_device * 8} on 8 ranks "
        "without accumulation)"
    )


def foreign_hint(name: str, value: Any = None, known_keys: list[str] | None = None) -> str | None:
    """An unknown key's hint when another system uses `name`: "did you mean 'K'? how",
    or only the why where freetx has no such key. None when `name` is not in the table,
    or its freetx key is not one of `known_keys` (a recipe without it)."""
    entry = FOREIGN_KEYS.get(name)
    if entry is None:
        return None
    key = entry[0]
    why = foreign_why(name, value)
    if key is None:
        return f"no freetx key: {why}."
    if known_keys is not None and not ({key, key.split(".")[0]} & set(known_keys)):
        return None
    return f"did you mean '{key}'? " + (f"{why}." if why else "")

"""Bring your old config: a DeepSpeed JSON, an accelerate YAML, or the seeds' FSDP JSON /
YAML, read as the freetx overrides they mean (`freetx import`).

    found = import_config("deepspeed", read_config_file(path), world_size=8)
    found.overrides    # {"distributed.strategy": "zero2", "batch_size": 256, ...}
    found.launch       # freetx run's launch options: ["--nnodes", "2", ...]
    found.environment  # {"CUDA_VISIBLE_DEVICES": "0,1"}
    found.unmapped     # [(key, why it has no freetx equivalent), ...]
    found.notes        # where a mapped key means more or less in freetx

Batch sizes: freetx's `batch_size` is global (samples per optimizer step, over all ranks)
and `gradient_accumulation_steps` splits it into micro-batches; a per-GPU micro-batch is
multiplied by the accumulation steps and the GPUs (DeepSpeed's train_batch_size is
already global). "auto" values are filled in by the HF Trainer from arguments the file
does not hold: listed as unmapped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freetx.config.foreign_names import foreign_why, global_batch_note
from freetx.distributed.parallelize import (
    DATA_PARALLEL_STRATEGY,
    DTYPE_ABBREVIATIONS,
    DTYPES,
    FSDP_SHARDING_STRATEGIES,
    RESHARD_AFTER_FORWARD_STRATEGIES,
    ZERO_STAGE_STRATEGIES,
)
from freetx.errors import FreetxError

AUTO = (
    "auto: the HF Trainer fills it in from its own arguments, which this file does not hold; "
    "set the freetx key to the value the Trainer used"
)
BUCKETS = "FSDP2 communicates one block at a time (the block is the bucket); no bucket knob"
SHARDED_SAVES = (
    "freetx saves sharded DCP checkpoints; `freetx checkpoint convert` writes the full model"
)
BLOCKS = "freetx shards and checkpoints the model's blocks, found by type (block_types)"
ALWAYS = "freetx always does this (meta-device build, each rank loads its own shard)"
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
MAX_FILE_BYTES = 4 * 1024 * 1024  # a config file; anything larger is not one
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # but tab and newline
PRECISIONS = {"bf16": "bfloat16", "fp16": "float16", "no": "float32", "fp32": "float32"}

# keys with no freetx equivalent, and why, by format
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
ACCELERATE_UNMAPPED = {
    "compute_environment": "freetx runs on this machine or SLURM (`freetx launch slurm`)",
    "main_training_function": "freetx runs a recipe file's recipe_main",
    "same_network": "torchrun's rendezvous needs no such setting",
    "downcast_bf16": "a TPU setting",
    "enable_cpu_affinity": "no freetx equivalent; bind with numactl or SLURM's --cpu-bind",
    "tpu_env": "freetx runs on CUDA and CPU, not TPU",
    "tpu_use_cluster": "freetx runs on CUDA and CPU, not TPU",
    "tpu_use_sudo": "freetx runs on CUDA and CPU, not TPU",
    "deepspeed_config.zero3_init_flag": ALWAYS,
    "deepspeed_config.zero3_save_16bit_model": SHARDED_SAVES,
    "deepspeed_config.deepspeed_multinode_launcher": "freetx launches with torchrun "
    "(`freetx launch slurm` or `freetx launch torchrun`)",
}
SEED_TRAINING_UNMAPPED = {
    "test_batch_size": "evaluation batches are set in the recipe's eval section",
    "num_epochs": "freetx counts steps: set max_steps",
    "use_amp": "use distributed.mixed_precision.param_dtype",
}


@dataclass
class ImportedConfig:
    """What a foreign config means in freetx (see the module docstring)."""

    source: str = "the file"  # its path, for messages
    recipe: str = "RECIPE"  # the freetx recipe and config to start from, where known
    config: str = "CFG"
    overrides: dict[str, Any] = field(default_factory=dict)
    launch: list[str] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)
    unmapped: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def set(self, key: str, value: Any) -> None:
        """An override; text from the file holding a newline (or another control
        character) is refused: it cannot be pasted as one line."""
        if isinstance(value, str) and not value.isprintable():
            raise bad_value(self, key, value, "text on one line (no control characters)")
        self.overrides[key] = value

    def skip(self, key: str, why: str) -> None:
        self.unmapped.append((key, why))

    def override_args(self) -> list[str]:
        """`key=value` arguments for `freetx run RECIPE --config CFG ...`."""
        return [f"{k}={format_value(v)}" for k, v in self.overrides.items()]


def format_value(value: Any) -> str:
    """A value as an override writes it (true, null, [0.9,0.95], 2e-05)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    return str(value)


def read_config_file(path: str) -> dict:
    """A JSON or YAML file's top-level mapping; one paragraph when it is missing, broken,
    binary, a shell script, or a YAML file with aliases (which can expand without bound)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FreetxError(
            f"{path} does not exist (or is not a file); give the path to your old config, "
            "e.g. ds_config.json or ~/.cache/huggingface/accelerate/default_config.yaml."
        )
    if file.stat().st_size > MAX_FILE_BYTES:
        raise FreetxError(
            f"{path} is {file.stat().st_size // 1024 // 1024} MiB, too large for a config "
            "file; give the config file itself (a DeepSpeed JSON, an accelerate or torchtune "
            "YAML)."
        )
    import yaml

    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text or CONTROL.search(text):
        raise FreetxError(
            f"{path} is not a text file (it holds bytes no JSON or YAML file has); give the "
            "config file itself (a DeepSpeed JSON, an accelerate or torchtune YAML)."
        )
    if text.startswith("#!") or re.search(r"^#SBATCH", text, re.MULTILINE):
        raise FreetxError(
            f"{path} is a shell script{' (a SLURM batch script)' if '#SBATCH' in text else ''}"
            ", and freetx import reads config files, not scripts. Its launch settings are "
            "freetx launch's options: `freetx launch slurm --nodes N --gpus-per-node G "
            "--time T --partition P RECIPE --config CFG` writes freetx's SLURM script; give "
            "`freetx import` the config files the script passes (ds_config.json, ...)."
        )
    kind = "JSON" if file.suffix == ".json" else "YAML"
    try:
        if file.suffix == ".json":
            data = json.loads(text)
        else:
            refuse_yaml_aliases(path, text)
            data = yaml.safe_load(text)
    except (ValueError, RecursionError, yaml.YAMLError) as e:
        detail = (
            " ".join(str(e).split()) if not isinstance(e, RecursionError) else "nested too deep"
        )
        raise FreetxError(
            f"{path} is not valid {kind}: {detail}. Fix the file (a .json file is read as "
            "JSON, anything else as YAML)."
        ) from None
    if not isinstance(data, dict):
        raise FreetxError(
            f"{path} holds a {type(data).__name__}, not a mapping of keys to values; give "
            "the config file itself."
        )
    refuse_non_finite(path, data)
    return data


def refuse_yaml_aliases(path: str, text: str) -> None:
    """YAML aliases (`*name`) refused before anything is built: a few lines of them can
    stand for billions of values (an "alias bomb"), and no config freetx imports needs one.
    The event scan is linear in the file's size."""
    import yaml

    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            line = event.start_mark.line + 1 if event.start_mark else "?"
            raise FreetxError(
                f"{path} uses a YAML alias (*{event.anchor}, line {line}); freetx import "
                "refuses aliases, since a few of them can stand for billions of values. "
                "Write the values out in full (or give the file `yaml.safe_load` then "
                "`yaml.safe_dump` wrote)."
            )


def refuse_non_finite(path: str, data: Any, key: str = "") -> None:
    """NaN and infinities (JSON's NaN, 1e400) refused, naming the key."""
    if isinstance(data, dict):
        for name, value in data.items():
            refuse_non_finite(path, value, f"{key}{name}" if not key else f"{key}.{name}")
    elif isinstance(data, list):
        for i, value in enumerate(data):
            refuse_non_finite(path, value, f"{key}[{i}]")
    elif isinstance(data, float) and not math.isfinite(data):
        raise FreetxError(
            f"{path}: {key or 'the value'} is {data} (a {'NaN' if data != data else 'number too large for a float'}), "
            "which no setting means; fix the value in the file. Nothing was printed."
        )


def import_config(
    kind: str,
    data: dict,
    world_size: int | None = None,
    source: str = "the file",
) -> ImportedConfig:
    """The freetx overrides a foreign config of `kind` (deepspeed, accelerate, fsdp-config)
    means; one paragraph for a value no setting can mean (`bad_value`). torchtune's:
    freetx.planning.torchtune_import."""
    found = ImportedConfig(source=source)
    {"deepspeed": _deepspeed, "accelerate": _accelerate, "fsdp-config": _seed_fsdp}[kind](
        found, data, world_size
    )
    return found


# -- what the formats share ------------------------------------------------------------
def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.lower() == "auto"


# what a number may be, by what it counts: (integer, lowest, highest)
COUNT = (True, 1, 10**9)  # batch sizes, processes, steps of accumulation
STEPS = (True, 0, 10**12)  # training or warmup steps
RATE = (False, 0.0, 10.0)  # learning rates, weight decay, betas
NORM = (False, 0.0, 1e9)  # gradient clipping


def bad_value(found: ImportedConfig, key: str, value: Any, expected: str) -> FreetxError:
    """One paragraph for a value no freetx setting can mean: huge, negative, not a
    number, the wrong type; the import prints nothing."""
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return FreetxError(
        f"{found.source}: {CONTROL.sub('?', key)} is {shown}, but it must be {expected}; "
        "fix the value in the file and import it again. Nothing was printed."
    )


def _number(
    found: ImportedConfig, key: str, value: Any, kind: tuple[bool, float, float] = COUNT
) -> float | None:
    """A numeric value in `kind`'s range, None when it is "auto" (listed as unmapped);
    anything else is refused (`bad_value`). YAML's `2e-5` (a string to PyYAML) is a
    number."""
    if _is_auto(value):
        found.skip(key, AUTO)
        return None
    integer, low, high = kind
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    what = f"{'a whole number' if integer else 'a number'} from {low:g} to {high:g}"
    if isinstance(value, bool) or not isinstance(number, (int, float)):
        raise bad_value(found, key, value, what)
    if not math.isfinite(number) or not low <= number <= high:
        raise bad_value(found, key, value, what)
    if integer:
        if number != int(number):
            raise bad_value(found, key, value, what)
        return int(number)
    return number


def set_batch(
    found: ImportedConfig,
    micro: tuple[str, Any] | None,
    accumulation: tuple[str, Any] | None,
    world_size: int | None,
) -> None:
    """batch_size (global) = per-GPU micro-batch x accumulation steps x GPUs."""
    steps = _number(found, *accumulation) if accumulation else 1
    if accumulation and steps is not None:
        found.set("gradient_accumulation_steps", int(steps))
    if micro is None:
        return
    per_gpu = _number(found, *micro)
    if per_gpu is None or steps is None:
        return
    if world_size is None:
        found.skip(
            micro[0],
            f"a per-device batch ({int(per_gpu)}); {global_batch_note(int(per_gpu))}: give "
            "--world-size N (the processes) and it is multiplied out",
        )
        return
    total = int(per_gpu) * int(steps) * world_size
    found.set("batch_size", total)
    found.notes.append(
        f"batch_size={total} is global: {micro[0]}={int(per_gpu)} per device x "
        f"{world_size} ranks (--world-size) x gradient_accumulation_steps={int(steps)}; "
        "freetx splits it back into per-rank micro-batches"
    )


def set_precision(found: ImportedConfig, key: str, name: Any) -> None:
    """Mixed precision by any of its names (bf16, BFLOAT16, true) -> the dtype knobs; the
    gradients are reduced in float32 (torchtitan's policy) unless the file says otherwise."""
    if isinstance(name, bool):  # fsdp_mixed_precision: true
        dtype = "bfloat16" if name else "float32"
    else:
        text = str(name).lower()
        dtype = PRECISIONS.get(text, DTYPE_ABBREVIATIONS.get(text, text))
    if dtype not in DTYPES:
        found.skip(key, f"{name!r}: freetx computes in float32, bfloat16 or float16")
        return
    found.set("distributed.mixed_precision.param_dtype", dtype)
    found.overrides.setdefault("distributed.mixed_precision.reduce_dtype", "float32")


def set_dtype(found: ImportedConfig, key: str, knob: str, name: Any) -> None:
    dtype = DTYPE_ABBREVIATIONS.get(str(name).lower(), str(name).lower())
    if dtype not in DTYPES:
        found.skip(key, f"{name!r} is not float32, bfloat16 or float16")
        return
    found.set(f"distributed.mixed_precision.{knob}", dtype)


OPTIMIZER_OFFLOAD_NOTE = (
    "optimizer.offload=cpu keeps the optimizer's states, an fp32 copy of the parameters and "
    "the optimizer step on the CPU, parameters and gradients on the GPU (ZeRO-Offload)"
)
PARAMETER_OFFLOAD_NOTE = (
    "distributed.cpu_offload=true moves parameters, gradients and the optimizer step to "
    "the CPU together (FSDP2's CPUOffloadPolicy; sharded strategies only)"
)
BOTH_OFFLOADS_NOTE = (
    "offload_optimizer is taken in by distributed.cpu_offload=true, which steps the "
    "optimizer on the CPU already (no optimizer.offload)"
)


def set_offload(found: ImportedConfig, key: str, device: Any) -> None:
    """DeepSpeed's offload devices, each to its own key: offload_optimizer's cpu ->
    optimizer.offload=cpu (ZeRO-Offload), offload_param's -> distributed.cpu_offload
    (FSDP2's CPUOffloadPolicy: parameters, gradients and the optimizer step on the CPU
    together, so with both, cpu_offload alone); an NVMe device is not mapped, said by name."""
    text = str(device).lower()
    if text in ("none", "null", ""):
        return
    optimizer = "offload_optimizer" in key
    if text != "cpu":
        what = "optimizer's states" if optimizer else "parameters"
        found.skip(key, f"{device!r}: freetx offloads the {what} to the CPU only; "
                   "DeepSpeed's NVMe offload (ZeRO-Infinity) has no freetx equivalent")  # fmt: skip
        return
    if optimizer and found.overrides.get("distributed.cpu_offload"):
        notes = [BOTH_OFFLOADS_NOTE]
    elif optimizer:
        found.set("optimizer.offload", "cpu")
        notes = [OPTIMIZER_OFFLOAD_NOTE]
    else:
        found.set("distributed.cpu_offload", True)
        notes = [PARAMETER_OFFLOAD_NOTE]
        if found.overrides.pop("optimizer.offload", None):  # the optimizer's came first
            found.notes.remove(OPTIMIZER_OFFLOAD_NOTE)
            notes.append(BOTH_OFFLOADS_NOTE)
    found.notes.extend(note for note in notes if note not in found.notes)


def _pop(flat: dict[str, Any], *keys: str) -> tuple[str, Any] | None:
    """(key, value) of the first of `keys` the file has, taken out of `flat`."""
    key = next((k for k in keys if k in flat), None)
    return None if key is None else (key, flat.pop(key))


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def set_number(
    found: ImportedConfig, key: str, value: Any, target: str, kind: tuple[bool, float, float]
) -> None:
    number = _number(found, key, value, kind)
    if number is not None:
        found.set(target, number)


def set_clipping(found: ImportedConfig, key: str, value: Any) -> None:
    """A clipping norm -> max_grad_norm (0, "no clipping" to DeepSpeed, is null)."""
    norm = _number(found, key, value, NORM)
    if norm is not None:
        found.set("max_grad_norm", None if norm == 0 else norm)


def set_betas(found: ImportedConfig, key: str, value: Any) -> None:
    if _is_auto(value):
        found.skip(key, AUTO)
        return
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise bad_value(found, key, value, "two numbers, e.g. [0.9, 0.95]")
    found.set("optimizer.betas", [_number(found, key, v, (False, 0.0, 0.999999)) for v in value])


def _flag(found: ImportedConfig, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_value(found, key, value, "true or false")
    return value


def _mapping(found: ImportedConfig, key: str, value: Any) -> dict:
    """A section that must be a mapping (accelerate's fsdp_config, ...); None is empty."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_value(found, key, value, "a mapping of keys to values (a YAML section)")
    return value


def _seed_key(found: ImportedConfig, key: str, name: str, value: Any) -> bool:
    """A training key of the seeds' YAML or the HF Trainer's (`training.gradient_clip_norm`,
    `distributed.gradient_accumulation_steps`, `num_workers`, `use_deepspeed`), met in any
    importer's file; False when `name` is none of them."""
    if name in ("gradient_clip_norm", "gradient_clipping", "max_grad_norm", "grad_clip",
                "clip_grad_norm"):  # fmt: skip
        set_clipping(found, key, value)
    elif name == "gradient_accumulation_steps":
        set_number(found, key, value, "gradient_accumulation_steps", COUNT)
    elif name in ("num_workers", "dataloader_num_workers"):
        set_number(found, key, value, "num_workers", (True, 0, 1024))
    elif name in ("learning_rate", "lr"):
        set_number(found, key, value, "optimizer.lr", RATE)
    elif name == "weight_decay":
        set_number(found, key, value, "optimizer.weight_decay", RATE)
    elif name == "warmup_steps":
        set_number(found, key, value, "lr_schedule.warmup_steps", STEPS)
    elif name in ("steps", "max_steps"):
        set_number(found, key, value, "max_steps", (True, 1, 10**12))
    elif name == "use_deepspeed":
        found.skip(key, foreign_why("use_deepspeed"))
    elif name == "deepspeed_config" and isinstance(value, str):
        found.skip(key, f"a DeepSpeed file: run `freetx import deepspeed {value}`")
    elif name == "fsdp_config" and isinstance(value, str):
        found.skip(key, f"an FSDP file: run `freetx import fsdp-config {value}`")
    elif name in SEED_TRAINING_UNMAPPED:
        found.skip(key, SEED_TRAINING_UNMAPPED[name])
    else:
        return False
    return True


# -- DeepSpeed ------------------------------------------------------------------------
def _deepspeed(found: ImportedConfig, data: dict, world_size: int | None) -> None:
    flat = _flatten(data)
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
        component = OPTIMIZERS.get(str(optimizer_type).lower())
        if component is None:
            found.skip("optimizer.type", f"{optimizer_type!r}: name a torch optimizer in "
                       "optimizer._component_ (torch.optim.AdamW, torchao's 8-bit AdamW)")  # fmt: skip
        else:
            found.set("optimizer._component_", component)
    if scheduler_type is not None and scheduler_type not in SCHEDULE_DECAYS:
        found.skip("scheduler.type", f"{scheduler_type!r}: freetx's lr_schedule is warmup, then "
                   "cosine, linear or constant decay")  # fmt: skip
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


# -- FSDP keys (the seeds' JSON and YAML, accelerate's fsdp_config) --------------------
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
            found.skip(key, f"{value!r}: freetx has FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and "
                       "HYBRID_SHARD (its replica count: distributed.replicate_degree)")  # fmt: skip
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


def _seed_fsdp(found: ImportedConfig, data: dict, world_size: int | None) -> None:
    """The seeds' FSDP files: a flat JSON of fsdp_* keys, or a YAML whose `distributed:`
    holds them and whose `training:` holds batch size, precision and checkpointing."""
    flat = _flatten(data)
    per_gpu = ("batch_size", "micro_batch_size", "train_batch_size")  # the seeds' names
    micro = _pop(flat, *per_gpu, *(f"training.{name}" for name in per_gpu))
    steps = _pop(flat, *(f"{section}gradient_accumulation_steps"
                         for section in ("", "training.", "distributed.")))  # fmt: skip
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


# -- accelerate -----------------------------------------------------------------------
def _accelerate(found: ImportedConfig, data: dict, world_size: int | None) -> None:
    kind = str(data.get("distributed_type", "NO")).upper()
    processes = data.get("num_processes")
    machines = data.get("num_machines", 1)
    processes = None if processes is None else _number(found, "num_processes", processes)
    machines = 1 if machines is None else _number(found, "num_machines", machines)
    fsdp = _mapping(found, "fsdp_config", data.get("fsdp_config"))
    dynamo = _mapping(found, "dynamo_config", data.get("dynamo_config"))
    deepspeed = _mapping(found, "deepspeed_config", data.get("deepspeed_config"))
    if processes is not None and machines is not None:
        if processes > 1 or machines > 1:
            found.launch += [
                "--nnodes",
                str(machines),
                "--nproc-per-node",
                str(max(1, processes // machines)),
            ]
        if processes % machines:
            found.skip("num_processes", f"{processes} processes do not split over {machines} "
                       "machines; freetx launches the same count on every node")  # fmt: skip
    if machines != 1:
        for key, flag in (("machine_rank", "--node-rank"), ("main_process_ip", "--master-addr"),
                          ("main_process_port", "--master-port"),
                          ("rdzv_backend", "--rdzv-backend")):  # fmt: skip
            value = data.get(key)
            if value is None:
                continue
            if key == "machine_rank":
                value = _number(found, key, value, (True, 0, 10**6))
            elif key == "main_process_port":
                value = _number(found, key, value, (True, 1, 65535))
            found.launch += [flag, str(value)]  # printed quoted
    if kind in ("MULTI_GPU", "MULTI_CPU"):
        found.set("distributed.strategy", DATA_PARALLEL_STRATEGY)
    elif kind not in ("NO", "FSDP", "DEEPSPEED"):
        found.skip("distributed_type", f"{kind}: freetx runs DDP, ZeRO, FSDP2 and HSDP on "
                   "CUDA and CPU")  # fmt: skip
    if kind == "MULTI_CPU" or data.get("use_cpu") is True:
        found.set("device", "cpu")
    if data.get("mixed_precision") is not None:
        set_precision(found, "mixed_precision", data["mixed_precision"])
    gpu_ids = data.get("gpu_ids")
    if gpu_ids is not None and str(gpu_ids).lower() != "all":
        ids = str(gpu_ids).replace(" ", "")
        if not re.fullmatch(r"\d+(,\d+)*", ids):
            raise bad_value(found, "gpu_ids", gpu_ids, "all, or GPU numbers such as 0,1,2")
        found.environment["CUDA_VISIBLE_DEVICES"] = ids
    if data.get("debug") is True:
        found.environment["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    backend = str(dynamo.get("dynamo_backend", "NO")).upper()
    if backend == "INDUCTOR":
        found.set("distributed.compile", True)
    elif backend != "NO":
        found.skip("dynamo_config.dynamo_backend", f"{backend}: freetx compiles blocks with "
                   "inductor (distributed.compile=true)")  # fmt: skip
    world = world_size or processes
    found.notes.append(
        "accelerate's file holds no batch size: set batch_size to your script's per-GPU "
        f"batch x its gradient accumulation steps x {world or 'the GPUs'} (freetx's is global)"
    )
    if kind == "FSDP":
        found.overrides.setdefault("distributed.strategy", FSDP_SHARDING_STRATEGIES["FULL_SHARD"])
        for name, value in fsdp.items():
            if not _fsdp_key(found, f"fsdp_config.{name}", name, value):
                found.skip(f"fsdp_config.{name}", "not an FSDP key freetx maps")
    if kind == "DEEPSPEED":
        _accelerate_deepspeed(found, deepspeed, world)
    handled = {"distributed_type", "num_processes", "num_machines", "machine_rank",
               "main_process_ip", "main_process_port", "rdzv_backend", "use_cpu",
               "mixed_precision", "gpu_ids", "debug", "dynamo_config", "fsdp_config",
               "deepspeed_config"}  # fmt: skip
    for key in data:
        if key in ACCELERATE_UNMAPPED:
            found.skip(key, ACCELERATE_UNMAPPED[key])
        elif key not in handled:
            found.skip(key, "not an accelerate key freetx maps")


def _accelerate_deepspeed(found: ImportedConfig, ds: dict, world_size: int | None) -> None:
    """accelerate's deepspeed_config section (its own key names)."""
    for name, value in ds.items():
        key = f"deepspeed_config.{name}"
        if name == "deepspeed_config_file":
            found.skip(key, f"a DeepSpeed file: run `freetx import deepspeed {value}`")
        elif name == "zero_stage":
            _deepspeed_key(found, "zero_optimization.stage", value)
        elif name in ("offload_optimizer_device", "offload_param_device"):
            set_offload(found, key, value)
        elif name == "gradient_accumulation_steps":
            set_batch(found, None, (key, value), world_size)
        elif name == "gradient_clipping":
            _deepspeed_key(found, "gradient_clipping", value)
        elif key in ACCELERATE_UNMAPPED:
            found.skip(key, ACCELERATE_UNMAPPED[key])
        else:
            found.skip(key, "not an accelerate DeepSpeed key freetx maps")

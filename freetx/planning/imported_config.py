"""What a foreign config means in freetx (`ImportedConfig`), and what every format's
importer shares (freetx.planning.config_import reads the file and picks the importer):
the reasons several formats give for a key freetx does not map, the ranges a number may
take, the one-paragraph refusal of a value no setting means (`bad_value`), and the
setters of the keys every format has (batch sizes, precision, offload, clipping, the
seeds' and the HF Trainer's training keys)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freetx.config.foreign_names import foreign_why, global_batch_note
from freetx.distributed.config import DTYPE_ABBREVIATIONS, DTYPES
from freetx.errors import FreetxError

AUTO = (
    "auto: the HF Trainer fills it in from its own arguments, which this file does not hold; "
    "set the freetx key to the value the Trainer used"
)
SHARDED_SAVES = (
    "freetx saves sharded DCP checkpoints; `freetx checkpoint convert` writes the full model"
)
BLOCKS = "freetx shards and checkpoints the model's blocks, found by type (block_types)"
ALWAYS = "freetx always does this (meta-device build, each rank loads its own shard)"
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # but tab and newline
PRECISIONS = {"bf16": "bfloat16", "fp16": "float16", "no": "float32", "fp32": "float32"}

# the seeds' and the HF Trainer's training keys with no freetx equivalent, and why
SEED_TRAINING_UNMAPPED = {
    "test_batch_size": "evaluation batches are set in the recipe's eval section",
    "num_epochs": "freetx counts steps: set max_steps",
    "use_amp": "use distributed.mixed_precision.param_dtype",
}


@dataclass
class ImportedConfig:
    """What a foreign config means in freetx (see freetx.planning.config_import)."""

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
    if isinstance(value, dict):  # YAML's flow style, quoted where needed
        import yaml

        return yaml.safe_dump(
            value, default_flow_style=True, width=math.inf, sort_keys=False
        ).strip()
    return str(value)


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
    group: tuple[str, Any] | None = None,
) -> None:
    """batch_size (global) = per-GPU micro-batch x accumulation steps x GPUs; with `group`
    (TRL's GRPO: a batch of completions, `group` of them per prompt), over it: freetx's
    GRPO batch_size counts prompts."""
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
    made = (
        f"{micro[0]}={int(per_gpu)} per device x {world_size} ranks (--world-size) x "
        f"gradient_accumulation_steps={int(steps)}"
    )
    unit, size = ("", 1) if group is None else (group[0], int(_number(found, *group) or 1))
    if total % size:
        raise bad_value(
            found,
            micro[0],
            micro[1],
            f"a batch of completions ({made} = {total}) that {unit}={size} divides",
        )
    found.set("batch_size", total // size)
    if group is None:
        found.notes.append(
            f"batch_size={total} is global: {made}; freetx splits it back into per-rank "
            "micro-batches"
        )
    else:
        found.notes.append(
            f"batch_size={total // size} prompts is global: {made} = {total} completions, "
            f"{size} per prompt ({unit}); freetx's GRPO batch_size counts prompts"
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
        found.skip(
            key,
            f"{device!r}: freetx offloads the {what} to the CPU only; "
            "DeepSpeed's NVMe offload (ZeRO-Infinity) has no freetx equivalent",
        )
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
    if name in (
        "gradient_clip_norm",
        "gradient_clipping",
        "max_grad_norm",
        "grad_clip",
        "clip_grad_norm",
    ):
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


# -- what the recipe-config importers share (torchtune, axolotl, TRL) ----------------------
# a model's name (torchtune's builder, an HF folder or Hub name), letters and digits only ->
# freetx's configs for that family: (full fine-tuning, LoRA); a name holding none of these
# starts from the 8B configs (any HF folder)
FAMILY_CONFIGS = {
    "llama321b": ("llm/llama3_2_1b_full", "llm/llama3_1_8b_lora"),
    "llama323b": ("llm/llama3_2_1b_full", "llm/llama3_1_8b_lora"),
    "llama318b": ("llm/llama3_1_8b_full", "llm/llama3_1_8b_lora"),
    "llama38b": ("llm/llama3_1_8b_full", "llm/llama3_1_8b_lora"),
    "llama3170b": ("llm/llama3_70b_full", "llm/llama3_70b_lora"),
    "llama3370b": ("llm/llama3_70b_full", "llm/llama3_70b_lora"),
    "llama370b": ("llm/llama3_70b_full", "llm/llama3_70b_lora"),
    "qwen257b": ("llm/qwen2_5_7b_full", "llm/llama3_1_8b_lora"),
    "qwen38b": ("llm/qwen3_8b_full", "llm/llama3_1_8b_lora"),
    "gemma22b": ("llm/gemma2_2b_full", "llm/llama3_1_8b_lora"),
    "phi4mini": ("llm/llama3_1_8b_full", "llm/phi4_mini_lora"),
}
DEFAULT_CONFIGS = ("llm/llama3_1_8b_full", "llm/llama3_1_8b_lora")
QLORA_CONFIG = "llm/llama3_1_8b_qlora"
HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+$")  # a Hugging Face Hub repository: owner/name
DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".arrow", ".txt")
EPOCHS = (False, 0.0, 1e6)
# LoRA's numbers: the peft key -> its range (every importer's names map onto these)
LORA_NUMBERS = {
    "peft.rank": COUNT,
    "peft.alpha": (False, 0.0, 1e6),
    "peft.dropout": (False, 0.0, 1.0),
}  # the HF Trainer's epochs may be a fraction


def family_configs(model: str) -> tuple[tuple[str, str], bool]:
    """(full, LoRA) configs for the family a model's name holds (Llama-3.2-1B-Instruct,
    llama3_2_1b), and whether a family was found (else the 8B configs: any HF folder)."""
    name = re.sub(r"[^a-z0-9]", "", model.lower())
    family = next((k for k in sorted(FAMILY_CONFIGS, key=len, reverse=True) if k in name), None)
    return FAMILY_CONFIGS.get(family, DEFAULT_CONFIGS), family is not None


def set_model_dir(found: ImportedConfig, key: str, model: Any) -> None:
    """The base model -> model_dir: a local HF folder as it is; a Hub name is printed as
    model_dir too, with a note that freetx reads local folders only."""
    if not isinstance(model, str) or not model:
        raise bad_value(found, key, model, "the base model's HF folder or Hub name")
    found.set("model_dir", model)
    if not Path(model).expanduser().is_dir():
        hub = HUB_NAME.match(model)
        found.notes.append(
            f"{key} {model} is "
            + ("a Hugging Face Hub name" if hub else "not a folder on this machine")
            + ": freetx reads the model, its tokenizer and its weights from a local HF folder"
            + (f" (huggingface-cli download {model} --local-dir DIR)" if hub else "")
            + "; set model_dir=DIR"
        )


def set_dataset_source(found: ImportedConfig, key: str, source: Any) -> None:
    """A dataset's files -> dataset.source; a Hub dataset name is listed (freetx reads
    local files: download it)."""
    if isinstance(source, list) and len(source) == 1:
        source = source[0]
    if isinstance(source, list) and all(isinstance(s, str) for s in source):
        found.set("dataset.source", source)
    elif not isinstance(source, str) or not source:
        raise bad_value(found, key, source, "a data file, a folder or a Hub dataset name")
    elif is_hub_dataset(source):
        found.skip(
            key,
            f"{source} is a Hugging Face Hub dataset; freetx reads local files: download it "
            f"(huggingface-cli download --repo-type dataset {source}) and set dataset.source=PATH",
        )
    else:
        found.set("dataset.source", source)


def is_hub_dataset(source: str) -> bool:
    """owner/name, no such path here, and no data file's suffix (data/train.jsonl is a file
    not copied here yet)."""
    path = Path(source).expanduser()
    return (
        HUB_NAME.match(source) is not None
        and not path.exists()
        and path.suffix.lower() not in DATA_SUFFIXES
    )


def set_epochs(
    found: ImportedConfig,
    epochs: tuple[str, Any] | None,
    per_epoch_cap: tuple[str, Any] | None,
    dataset_size: int | None,
    kind: tuple[bool, float, float] = COUNT,
) -> None:
    """epochs x steps per epoch -> max_steps: steps per epoch are the training samples
    over the global batch (the last partial batch dropped), capped by `per_epoch_cap`."""
    cap = (
        None
        if per_epoch_cap is None or per_epoch_cap[1] is None
        else _number(found, *per_epoch_cap)
    )
    if epochs is None or epochs[1] is None:
        return
    key = epochs[0]
    count = _number(found, key, epochs[1], kind)
    if count is None:
        return
    shown = f"{count:g}"
    batch = found.overrides.get("batch_size")
    if cap is not None and (dataset_size is None or batch is None):
        found.set("max_steps", max(1, round(count * cap)))
        return
    if dataset_size is None or batch is None:
        missing = " and ".join(
            what
            for what, known in (
                ("--dataset-size N (the training samples)", dataset_size),
                ("--world-size N", batch),
            )
            if known is None
        )
        found.skip(
            key,
            f"{shown} epoch(s): freetx counts optimizer steps; give {missing} "
            "and max_steps is computed (epochs x samples / the global batch_size)",
        )
        return
    per_epoch = dataset_size // batch
    if per_epoch < 1:
        raise bad_value(
            found,
            key,
            epochs[1],
            f"run on a dataset of at least one batch ({batch} samples; --dataset-size is "
            f"{dataset_size})",
        )
    if cap is not None:
        per_epoch = min(per_epoch, int(cap))
    steps = max(1, round(count * per_epoch))
    found.set("max_steps", steps)
    found.notes.append(
        f"max_steps={steps}: {shown} epoch(s) x {per_epoch} steps ({dataset_size} "
        f"samples // batch_size {batch}"
        + (f", capped at {per_epoch_cap[0]}={int(cap)}" if cap is not None else "")
        + ")"
    )

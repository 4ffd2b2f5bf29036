"""A torchtune recipe config read as freetx overrides (`freetx import torchtune`).

torchtune's config names a model builder (torchtune.models.llama3_2.llama3_2_1b), a
checkpointer whose `checkpoint_dir` is the HF folder, a tokenizer file, a dataset
builder, an optimizer, per-device batch sizes and epochs. freetx reads the model, its
tokenizer and its weights from one HF folder (`model_dir`), counts optimizer steps
(`max_steps`) and a global batch. What maps:

    checkpointer.checkpoint_dir -> model_dir      checkpointer.output_dir -> output_dir
    model builder -> the freetx config to start from (full, LoRA or QLoRA)
    model.lora_rank / lora_alpha / lora_dropout / lora_attn_modules -> peft.*
    tokenizer.max_seq_len -> dataset.seq_len   tokenizer.path -> tokenizer.path (a folder)
    dataset builder + source files -> dataset._component_, source, format
    optimizer.{lr, weight_decay, betas, eps} -> optimizer.*
    lr_scheduler.num_warmup_steps -> lr_schedule.warmup_steps (cosine to 0)
    batch_size x gradient_accumulation_steps x --world-size -> batch_size (global)
    epochs x steps per epoch (--dataset-size) -> max_steps
    dtype -> distributed.mixed_precision.param_dtype, clip_grad_norm -> max_grad_norm,
    enable_activation_checkpointing, compile, fsdp_cpu_offload -> distributed.*

Every other key is listed with why (freetx.config.foreign_names holds the names
torchtune users bring, for `freetx validate`'s hints too).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from freetx.config.foreign_names import foreign_key, foreign_why
from freetx.distributed.config import RESHARD_AFTER_FORWARD_STRATEGIES
from freetx.planning.imported_config import (
    COUNT,
    LORA_NUMBERS,
    NORM,
    QLORA_CONFIG,
    RATE,
    STEPS,
    ImportedConfig,
    _flag,
    _mapping,
    _pop,
    bad_value,
    family_configs,
    set_batch,
    set_betas,
    set_dataset_source,
    set_epochs,
    set_number,
    set_precision,
)

# torchtune's LoRA module names -> freetx's (peft.target_modules)
LORA_MODULES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "output_proj": "o"}
MLP_MODULES = ["gate", "up", "down"]  # apply_lora_to_mlp: torchtune's w1, w3, w2
# torchtune's dataset builders -> (freetx's dataset component, its format)
DATASETS = {
    "alpaca_dataset": ("freetx.data.InstructDataset", "alpaca"),
    "alpaca_cleaned_dataset": ("freetx.data.InstructDataset", "alpaca"),
    "instruct_dataset": ("freetx.data.InstructDataset", None),
    "chat_dataset": ("freetx.data.ChatDataset", None),
    "slimorca_dataset": ("freetx.data.ChatDataset", "sharegpt"),
    "text_completion_dataset": ("freetx.data.PackedTextDataset", None),
}
CONVERSATION_STYLES = {"sharegpt": "sharegpt", "openai": "messages"}
LOCAL_FORMATS = ("json", "csv", "parquet", "text", "arrow")

UNMAPPED = {
    "metric_logger": "freetx's loggers are metric_loggers (progress bar, JSONL, TensorBoard, "
    "WandB); the recipe's config lists them",
    "profiler": "profiler.enabled=true writes a torch.profiler trace",
    "loss": "freetx's loss is chunked already (loss.num_chunks, chosen by the vocabulary)",
    "checkpointer._component_": "freetx reads HF folders (config.json, *.safetensors) and "
    "saves DCP checkpoints; `freetx checkpoint convert --to hf` writes HF folders",
    "checkpointer.checkpoint_files": "freetx reads every *.safetensors file of model_dir "
    "(by model.safetensors.index.json)",
    "checkpointer.model_type": "freetx reads the family from model_dir's config.json",
    "checkpointer.recipe_checkpoint": "freetx resumes from output_dir's DCP checkpoints "
    "(resume=auto)",
    "checkpointer.adapter_checkpoint": "freetx resumes adapters from output_dir (resume=auto)",
    "tokenizer._component_": "freetx's HFTokenizer reads the HF folder's tokenizer.json and "
    "chat template (tokenizer.path=${model_dir})",
    "tokenizer.prompt_template": "freetx renders prompts with the HF folder's chat template",
    "optimizer.fused": "freetx fuses AdamW on CUDA itself",
    "dataset.train_on_input": "freetx's instruct and chat datasets put the loss on the "
    "responses only",
    "dataset.split": "freetx holds out dataset.val_fraction of the file for validation",
}


def import_torchtune(
    data: dict,
    world_size: int | None = None,
    source: str = "the file",
    dataset_size: int | None = None,
) -> ImportedConfig:
    """What a torchtune recipe config means in freetx (see the module docstring)."""
    found = ImportedConfig(source=source)
    data = _resolve(data)
    model = _mapping(found, "model", data.pop("model", None))
    builder = str(model.pop("_component_", "") or "")
    lora = _lora(found, model, builder)
    for key in model:
        found.skip(f"model.{key}", "freetx reads the model's shape from model_dir's config.json")
    _checkpointer(found, _mapping(found, "checkpointer", data.pop("checkpointer", None)), data)
    _base_config(found, builder, lora, data.get("output_dir"))
    _tokenizer(found, _mapping(found, "tokenizer", data.pop("tokenizer", None)))
    _dataset(found, data.pop("dataset", None))
    _optimizer(found, _mapping(found, "optimizer", data.pop("optimizer", None)))
    _scheduler(found, _mapping(found, "lr_scheduler", data.pop("lr_scheduler", None)))
    micro = ("batch_size", data.pop("batch_size")) if "batch_size" in data else None
    steps = data.pop("gradient_accumulation_steps", None)
    accumulation = None if steps is None else ("gradient_accumulation_steps", steps)
    set_batch(found, micro, accumulation, world_size)
    epochs, cap = _pop(data, "epochs"), _pop(data, "max_steps_per_epoch")
    set_epochs(found, epochs, cap, dataset_size)
    for key, value in data.items():
        _top_level(found, key, value)
    return found


def _resolve(data: dict) -> dict:
    """torchtune's `${output_dir}` interpolations of top-level keys, resolved (PyYAML
    leaves them as text)."""

    def interpolated(m: re.Match) -> str:
        key = m.group(1)
        return str(data[key]) if isinstance(data.get(key), str) else m.group(0)

    def resolve(value: Any) -> Any:
        if isinstance(value, str):
            return re.sub(r"\$\{(\w+)\}", interpolated, value)
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v) for v in value]
        return value

    return {k: resolve(v) for k, v in data.items()}


def _model_name(builder: str) -> str:
    """torchtune.models.llama3_2.lora_llama3_2_1b -> llama3_2_1b."""
    return re.sub(r"^(q?lora_)", "", builder.rsplit(".", 1)[-1])


def _lora(found: ImportedConfig, model: dict, builder: str) -> str | None:
    """LoRA's keys of the model node -> peft.*; "lora", "qlora" or None."""
    leaf = builder.rsplit(".", 1)[-1]
    kind = "qlora" if leaf.startswith("qlora_") else "lora" if leaf.startswith("lora_") else None
    if kind is None and "lora_rank" not in model:
        return None
    found.set("peft.method", "lora")
    if kind == "qlora":
        found.set("peft.quantize_base", "nf4")
    modules = model.pop("lora_attn_modules", None)
    if modules is not None:
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise bad_value(
                found,
                "model.lora_attn_modules",
                modules,
                "a list of module names (q_proj, k_proj, v_proj, output_proj)",
            )
        targets = [LORA_MODULES.get(m, m) for m in modules]
        if _flag(found, "model.apply_lora_to_mlp", model.pop("apply_lora_to_mlp", False)):
            targets += MLP_MODULES
        if _flag(found, "model.apply_lora_to_output", model.pop("apply_lora_to_output", False)):
            targets.append("output")
        found.set("peft.target_modules", targets)
    for name, target in zip(("lora_rank", "lora_alpha", "lora_dropout"), LORA_NUMBERS):
        if name in model:
            set_number(found, f"model.{name}", model.pop(name), target, LORA_NUMBERS[target])
    if "use_dora" in model:
        found.set("peft.use_dora", _flag(found, "model.use_dora", model.pop("use_dora")))
    model.pop("quantize_base", None)  # qlora_ builders say it already
    return kind or "lora"


def _base_config(found: ImportedConfig, builder: str, lora: str | None, output_dir: Any) -> None:
    (full, lora_config), family = family_configs(_model_name(builder))
    config = QLORA_CONFIG if lora == "qlora" else lora_config if lora else full
    found.recipe = "lora_finetune_fsdp2" if lora else "full_finetune_fsdp2"
    found.config = config
    if builder:
        found.notes.append(
            f"model {builder}: freetx builds the model from model_dir's config.json (an HF "
            f"folder); start from --config {config}"
            + (
                ""
                if family
                else " (no freetx config for this family; the model comes from "
                "model_dir whatever its size)"
            )
        )
    else:
        found.skip("model", "no model._component_: the model comes from model_dir")


def _checkpointer(found: ImportedConfig, checkpointer: dict, data: dict) -> None:
    folder = checkpointer.pop("checkpoint_dir", None)
    if folder is not None:
        found.set("model_dir", str(folder))
        found.set("checkpoint.initial_weights", "${model_dir}")
    else:
        found.notes.append("no checkpointer.checkpoint_dir: set model_dir=HF_FOLDER")
    output_dir = checkpointer.pop("output_dir", None)
    if output_dir is not None and "output_dir" not in data:
        found.set("output_dir", str(output_dir))
    _skip_rest(found, "checkpointer", checkpointer, "not a checkpointer key freetx maps")


def _tokenizer(found: ImportedConfig, tokenizer: dict) -> None:
    path = tokenizer.pop("path", None)
    if path is not None:
        folder = Path(str(path)).parent
        model_dir = found.overrides.get("model_dir")
        inside = model_dir is not None and (
            folder == Path(model_dir) or folder.parent == Path(model_dir)
        )
        if not inside:
            found.set("tokenizer.path", str(folder))
        found.notes.append(
            f"tokenizer {path}: freetx's HFTokenizer reads the folder's tokenizer.json and "
            "chat template" + (" (model_dir's, the config's default)" if inside else "")
        )
    seq_len = tokenizer.pop("max_seq_len", None)
    if seq_len is not None:
        set_number(found, "tokenizer.max_seq_len", seq_len, "dataset.seq_len", COUNT)
    _skip_rest(found, "tokenizer", tokenizer, "not a tokenizer key freetx maps")


def _dataset(found: ImportedConfig, node: Any) -> None:
    if isinstance(node, list):
        found.skip(
            "dataset",
            "a list of datasets: freetx's mixture is freetx.data.Mixture "
            "(docs/data.md); import one entry at a time",
        )
        return
    dataset = dict(_mapping(found, "dataset", node))
    builder = str(dataset.pop("_component_", "") or "")
    known = DATASETS.get(builder.rsplit(".", 1)[-1])
    if builder and known is None:
        found.skip(
            "dataset._component_",
            f"{builder}: no freetx equivalent; freetx reads instruct, chat and text files "
            "(freetx.data.InstructDataset, ChatDataset, PackedTextDataset)",
        )
    elif known is not None:
        found.set("dataset", known[0])  # the component shorthand: the keys stay
        if known[1]:
            found.set("dataset.format", known[1])
    source = dataset.pop("source", "tatsu-lab/alpaca" if "alpaca" in builder else None)
    files = dataset.pop("data_files", None)
    if isinstance(files, list) and len(files) == 1:
        files = files[0]
    if files is not None:
        set_dataset_source(found, "dataset.data_files", files)
    elif isinstance(source, str) and source not in LOCAL_FORMATS:
        set_dataset_source(found, "dataset.source", source)
    style = dataset.pop("conversation_style", None)
    if style is not None:
        if str(style) not in CONVERSATION_STYLES:
            found.skip(
                "dataset.conversation_style",
                f"{style!r}: freetx reads sharegpt and openai (messages) conversations",
            )
        else:
            found.set("dataset.format", CONVERSATION_STYLES[str(style)])
    column_map = dataset.pop("column_map", None)
    if column_map is not None:
        found.set("dataset.columns", _mapping(found, "dataset.column_map", column_map))
    if "packed" in dataset:
        found.set("dataset.packed", _flag(found, "dataset.packed", dataset.pop("packed")))
    _skip_rest(found, "dataset", dataset, "not a dataset key freetx maps")


def _optimizer(found: ImportedConfig, optimizer: dict) -> None:
    component = optimizer.pop("_component_", None)
    if component is not None:
        if str(component).startswith("torch.optim."):
            found.set("optimizer._component_", str(component))
        else:
            found.skip(
                "optimizer._component_",
                f"{component}: freetx builds torch optimizers and torchao's "
                "(optimizer._component_=torchao.optim.AdamW8bit for an 8-bit AdamW)",
            )
    for name in ("lr", "weight_decay", "eps"):
        if name in optimizer:
            set_number(found, f"optimizer.{name}", optimizer.pop(name), f"optimizer.{name}", RATE)
    if "betas" in optimizer:
        set_betas(found, "optimizer.betas", optimizer.pop("betas"))
    _skip_rest(found, "optimizer", optimizer, "not an optimizer argument freetx maps")


def _scheduler(found: ImportedConfig, scheduler: dict) -> None:
    if not scheduler:
        return
    component = str(scheduler.pop("_component_", ""))
    if component.endswith("get_cosine_schedule_with_warmup"):
        found.set("lr_schedule.decay", "cosine")
        found.set("lr_schedule.min_lr_ratio", 0.0)  # torchtune's cosine ends at 0
    elif component:
        found.skip(
            "lr_scheduler._component_",
            f"{component}: freetx's lr_schedule is warmup, then cosine, linear or constant decay",
        )
    if "num_warmup_steps" in scheduler:
        set_number(
            found,
            "lr_scheduler.num_warmup_steps",
            scheduler.pop("num_warmup_steps"),
            "lr_schedule.warmup_steps",
            STEPS,
        )
    for key in scheduler:
        found.skip(f"lr_scheduler.{key}", "not a schedule argument freetx maps")


def _top_level(found: ImportedConfig, key: str, value: Any) -> None:
    if key == "output_dir":
        found.set("output_dir", str(value))
    elif key == "seed":
        if value is None:
            found.skip("seed", "null (a random seed): freetx's seed is a number, 0 by default")
        else:
            set_number(found, key, value, "seed", (True, 0, 2**32 - 1))
    elif key == "device":
        if str(value) not in ("cuda", "cpu"):
            found.skip(key, f"{value!r}: freetx runs on cuda or cpu (device=auto picks)")
        else:
            found.set("device", str(value))
    elif key == "dtype":
        set_precision(found, key, value)
    elif key == "clip_grad_norm":
        if value is None:
            found.set("max_grad_norm", None)  # torchtune's null: no clipping (freetx: 1.0)
        else:
            set_number(found, key, value, "max_grad_norm", NORM)
    elif key == "log_every_n_steps":
        set_number(found, key, value, "log_every_n_steps", COUNT)
    elif key == "resume_from_checkpoint":
        if _flag(found, key, value):
            found.set("resume", "auto")
        else:
            found.notes.append(
                "resume_from_checkpoint: false: freetx's resume=auto continues from "
                "output_dir's newest checkpoint when there is one; resume=never starts afresh"
            )
    elif key in (
        "enable_activation_checkpointing",
        "compile",
        "fsdp_cpu_offload",
        "fsdp_reshard_after_forward",
        "enable_activation_offloading",
        "optimizer_in_bwd",
    ):
        on = _flag(found, key, value)
        if key == "enable_activation_checkpointing":
            found.set("distributed.activation_checkpointing", "full" if on else "none")
        elif key == "fsdp_reshard_after_forward":
            found.set("distributed.strategy", RESHARD_AFTER_FORWARD_STRATEGIES[on])
        else:
            found.set(foreign_key(key), on)
    elif key in UNMAPPED:
        found.skip(key, UNMAPPED[key])
    elif foreign_why(key) is not None:
        found.skip(key, foreign_why(key))
    else:
        found.skip(key, "not a torchtune key freetx maps")


def _skip_rest(found: ImportedConfig, section: str, keys: dict, what: str) -> None:
    """List the keys of a torchtune section left after mapping, each with why."""
    for key in keys:
        name = f"{section}.{key}"
        found.skip(name, UNMAPPED.get(name) or what)

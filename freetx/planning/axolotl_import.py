"""An axolotl config (examples/llama-3/lora-1b.yml, qlora-1b.yml, a DPO or GRPO config)
read as freetx overrides (`freetx import axolotl`).

Most of axolotl's keys are the HF Trainer's and TRL's under their names or a synonym
(micro_batch_size is per_device_train_batch_size, num_epochs num_train_epochs,
sequence_len max_length, optimizer optim, lr_scheduler lr_scheduler_type, its trl:
section GRPO's keys): they are renamed and mapped by freetx.planning.trl_import. axolotl's
own keys are read here:

    base_model -> model_dir (a local HF folder; a Hub name is said)
    adapter lora / qlora, lora_target_linear -> use_peft, load_in_4bit, all-linear
    rl dpo / ipo / orpo / simpo / grpo -> the recipe (dpo_fsdp2, grpo_fsdp2) and loss.type;
    kto: no freetx recipe, said
    rl_beta, orpo_alpha, dpo_label_smoothing, simpo_gamma -> loss.*
    datasets[0] path + type (alpaca, chat_template, sharegpt, completion, DPO's
    chatml.intel / llama3.argilla / ...) -> dataset._component_, source, format, columns
    val_set_size -> dataset.val_fraction, cosine_min_lr_ratio -> lr_schedule.min_lr_ratio

Every other key is listed with why.
"""

from __future__ import annotations

from typing import Any

from freetx.data.formats import DEFAULT_COLUMNS
from freetx.planning.imported_config import (
    ImportedConfig,
    _mapping,
    _number,
    bad_value,
    set_dataset_source,
    set_number,
)
from freetx.planning.trl_import import NO_RECIPE, Keys, map_trainer_keys

# axolotl's name -> TRL's (the HF Trainer's); what has the same name in both is passed as it is
RENAMED = {
    "base_model": "model_name_or_path",
    "micro_batch_size": "per_device_train_batch_size",
    "num_epochs": "num_train_epochs",
    "sequence_len": "max_length",
    "sample_packing": "packing",
    "optimizer": "optim",
    "lr_scheduler": "lr_scheduler_type",
    "rl_beta": "beta",
    "dpo_label_smoothing": "label_smoothing",
    "peft_use_dora": "use_dora",
    "peft_use_rslora": "use_rslora",
    "hub_model_id": "hub_model_id",
}
# rl: -> (the TRL trainer kind, freetx's loss.type)
RL = {
    "dpo": ("dpo", None),
    "ipo": ("dpo", "ipo"),
    "orpo": ("dpo", "orpo"),
    "simpo": ("dpo", "simpo"),
    "grpo": ("grpo", None),
    "kto": ("kto", None),
}
# a DPO dataset type's template (after its chat-template prefix: chatml.intel, llama3.argilla)
# -> its columns in freetx's preference format
PREFERENCE_COLUMNS = {
    "intel": {"prompt": "question"},
    "argilla": {
        "prompt": "instruction",
        "chosen": "chosen_response",
        "rejected": "rejected_response",
    },
    "argilla_chat": {},
    "icr": {"prompt": "instruction"},
    "prompt_pairs": {},
    "ultra": {},
    "default": {},
}
TOKENIZER = "freetx reads the model and its tokenizer from model_dir's files"
ATTENTION = "freetx picks its attention kernel itself (flash or SDPA)"
UNMAPPED = {
    "base_model_config": TOKENIZER,
    "model_type": TOKENIZER,
    "tokenizer_type": TOKENIZER,
    "tokenizer_config": TOKENIZER,
    "is_llama_derived_model": TOKENIZER,
    "is_mistral_derived_model": TOKENIZER,
    "is_qwen_derived_model": TOKENIZER,
    "special_tokens": "freetx uses model_dir's tokenizer and its special tokens as they are",
    "tokens": "freetx adds no tokens to model_dir's tokenizer",
    "chat_template": "freetx renders conversations with model_dir's chat template "
    "(tokenizer_config.json or chat_template.jinja): put the template you want there",
    "chat_template_jinja": "freetx renders conversations with model_dir's chat template: "
    "write it into the folder's chat_template.jinja",
    "dataset_prepared_path": "freetx tokenizes once into its token cache (dataset.cache)",
    "test_datasets": "freetx holds out dataset.val_fraction of the data for validation",
    "shuffle_merged_datasets": "freetx always shuffles the training samples",
    "pad_to_sequence_len": "freetx pads every sample to dataset.seq_len",
    "eval_sample_packing": "validation samples are packed as the training ones",
    "train_on_inputs": "freetx's chat and instruct datasets put the loss on the responses",
    "flash_attention": ATTENTION,
    "sdp_attention": ATTENTION,
    "xformers_attention": ATTENTION,
    "flash_attn_cross_entropy": "freetx's loss is chunked already (loss.num_chunks)",
    "lora_fan_in_fan_out": "freetx's LoRA wraps nn.Linear modules (no Conv1D layout)",
    "lora_model_dir": "freetx resumes adapters from output_dir (resume=auto)",
    "saves_per_epoch": "freetx counts steps: checkpoint.every_n_steps",
    "evals_per_epoch": "freetx counts steps: eval.every_n_steps",
    "batch_size": "axolotl's per-device batch x accumulation: give micro_batch_size and "
    "gradient_accumulation_steps, and batch_size (global) is made of them",
    "fsdp_version": "freetx is FSDP2 (fully_shard) throughout",
    "early_stopping_patience": "freetx runs max_steps; no early stopping",
    "group_by_length": "freetx's samples are all dataset.seq_len long (or packed)",
    "strict": "axolotl's own config check; `freetx validate` checks freetx's",
    "debug": "set FREETX_DEBUG=1 for tracebacks",
    "local_rank": "torchrun sets each rank's",
    "auto_resume_from_checkpoints": "freetx's resume=auto (the default) continues from output_dir",
    "cpo_alpha": "freetx has no CPO loss",
    "loss_watchdog_threshold": "freetx's NaN guard stops a run whose gradient norm is not finite",
    "loss_watchdog_patience": "freetx's NaN guard stops a run whose gradient norm is not finite",
    "dpo_use_weighting": "freetx's DPO weighs every pair alike",
    "dpo_padding_free": "freetx pads pairs to dataset.seq_len (dataset.packed packs them)",
}
LOGGERS = "add freetx's WandB logger to metric_loggers (docs/configs.md)"


def import_axolotl(
    data: dict,
    world_size: int | None = None,
    source: str = "the file",
    dataset_size: int | None = None,
) -> ImportedConfig:
    """What an axolotl config means in freetx (the module docstring)."""
    found = ImportedConfig(source=source)
    data = {str(key): value for key, value in data.items() if value is not None}  # null: unset
    rl = data.pop("rl", None)
    if rl is not None and (not isinstance(rl, str) or rl not in RL):
        raise bad_value(found, "rl", rl, f"one of {', '.join(RL)} (or no rl: SFT)")
    kind, loss_type = RL[rl] if rl is not None else ("sft", None)
    keys: Keys = {}
    adapter = data.pop("adapter", None)
    if adapter in ("lora", "qlora"):
        keys["use_peft"] = ("adapter", True)
        if adapter == "qlora":
            keys["load_in_4bit"] = ("adapter", True)
    elif adapter is not None:
        found.skip("adapter", f"{adapter!r}: freetx's adapters are LoRA and QLoRA (peft.*)")
    if data.pop("lora_target_linear", False) is True:
        keys["lora_target_modules"] = ("lora_target_linear", "all-linear")
    if "load_in_4bit" in data and adapter == "qlora":
        data.pop("load_in_4bit")  # qlora says it
    for name, value in _mapping(found, "trl", data.pop("trl", None)).items():
        keys[name] = (f"trl.{name}", value)
    if rl == "orpo" and "orpo_alpha" in data:
        keys["beta"] = ("orpo_alpha", data.pop("orpo_alpha"))  # freetx's orpo beta: its lambda
    dataset = data.pop("datasets", None)
    val_set_size = data.pop("val_set_size", None)
    simpo_gamma = data.pop("simpo_gamma", None)
    min_lr = data.pop("cosine_min_lr_ratio", None)
    for key, value in data.items():
        if key in UNMAPPED:
            found.skip(key, UNMAPPED[key])
        elif key.startswith("wandb_"):
            found.skip(key, LOGGERS)
        else:
            keys.setdefault(RENAMED.get(key, key), (key, value))
    map_trainer_keys(
        found,
        "dpo" if kind == "kto" else kind,
        keys,
        world_size,
        dataset_size,
        "not an axolotl key freetx maps",
    )
    if loss_type is not None:
        found.set("loss.type", loss_type)
    if simpo_gamma is not None:
        set_number(found, "simpo_gamma", simpo_gamma, "loss.gamma", (False, 0.0, 1e6))
    if min_lr is not None:
        set_number(found, "cosine_min_lr_ratio", min_lr, "lr_schedule.min_lr_ratio", (False, 0, 1))
    if val_set_size is not None:
        _validation(found, val_set_size)
    _datasets(found, kind, dataset)
    if kind == "kto":
        found.recipe, found.config = "RECIPE", "CFG"
        found.skip("rl", f"kto: {NO_RECIPE['kto']}; the overrides above are the rest of the file")
    return found


def _validation(found: ImportedConfig, size: Any) -> None:
    """val_set_size: a fraction of the data -> dataset.val_fraction; 0 and a count of rows
    are listed."""
    share = _number(found, "val_set_size", size, (False, 0.0, 1e12))
    if share is not None and 0 < share < 1:
        found.set("dataset.val_fraction", share)
    elif share is not None:
        found.skip(
            "val_set_size",
            f"{share:g}: freetx holds out a share of the rows, dataset.val_fraction in (0, 0.5)"
            + ("; the config's share is kept" if share == 0 else ""),
        )


def _datasets(found: ImportedConfig, kind: str, node: Any) -> None:
    """The first of `datasets:` -> dataset.*; more are listed (a freetx mixture)."""
    if node is None:
        return
    if not isinstance(node, list) or not node or not all(isinstance(d, dict) for d in node):
        raise bad_value(found, "datasets", node, "a list of datasets, each {path: ..., type: ...}")
    for i in range(1, len(node)):
        found.skip(
            f"datasets[{i}]",
            "freetx imports the first dataset; several are a freetx.data.Mixture (docs/data.md)",
        )
    entry = dict(node[0])
    files = entry.pop("data_files", None)
    path = entry.pop("path", None)
    set_dataset_source(found, "datasets[0].path", files if files is not None else path)
    dataset_type = entry.pop("type", None)
    if kind == "sft":
        _sft_dataset(found, dataset_type, entry)
    elif kind == "dpo":
        _preference_dataset(found, dataset_type, entry)
    elif dataset_type is not None:
        found.skip(
            "datasets[0].type",
            f"{dataset_type}: "
            + (
                "freetx has no KTO recipe"
                if kind == "kto"
                else "a Python transform of the rows; freetx's PromptDataset reads {prompt} or "
                "{messages} rows and the columns your rewards read: write the transformed rows "
                "to a .jsonl and set dataset.source=PATH"
            ),
        )
    for key in entry:
        found.skip(f"datasets[0].{key}", DATASET_UNMAPPED.get(key, "not a dataset key freetx maps"))


DATASET_UNMAPPED = {
    "ds_type": "freetx reads a file by its suffix (.jsonl, .json, .parquet, .csv)",
    "split": "freetx reads the files of dataset.source (a train split)",
    "name": "a subset of a Hub dataset: download that subset's files",
    "roles_to_train": "freetx puts the loss on the assistant's turns",
    "train_on_eos": "freetx puts the loss on the assistant's turns, their end tokens included",
    "conversation": "freetx renders conversations with model_dir's chat template",
}


def _sft_dataset(found: ImportedConfig, dataset_type: Any, entry: dict) -> None:
    if dataset_type == "alpaca":
        found.set("dataset", "freetx.data.InstructDataset")
        found.set("dataset.format", "alpaca")
    elif dataset_type in ("chat_template", "sharegpt"):
        found.set("dataset", "freetx.data.ChatDataset")
        _chat_columns(found, dataset_type, entry)
    elif dataset_type == "completion":
        found.set("dataset", "freetx.data.PackedTextDataset")
        field = entry.pop("field", "text")
        if field != "text":
            found.set("dataset.columns", {"text": str(field)})
    else:
        found.skip(
            "datasets[0].type",
            f"{dataset_type!r}: freetx reads alpaca, chat_template (messages), sharegpt and "
            "completion (text) rows; a prompt/response file is dataset=freetx.data."
            "InstructDataset dataset.format=prompt_response (dataset.columns maps its names)",
        )


def _chat_columns(found: ImportedConfig, dataset_type: str, entry: dict) -> None:
    """field_messages and message_property_mappings (or the older message_field_role /
    message_field_content) -> dataset.format and dataset.columns."""
    mappings = dict(
        _mapping(found, "datasets[0].message_property_mappings",
                 entry.pop("message_property_mappings", None))
    )  # fmt: skip
    for role in ("role", "content"):
        if f"message_field_{role}" in entry:
            mappings.setdefault(role, entry.pop(f"message_field_{role}"))
    sharegpt = dataset_type == "sharegpt" or mappings.get("role") == "from"
    fmt = "sharegpt" if sharegpt else "messages"
    given = {"messages": entry.pop("field_messages", DEFAULT_COLUMNS[fmt]["messages"])}
    given.update((role, mappings.pop(role)) for role in ("role", "content") if role in mappings)
    for extra in mappings:
        found.skip(
            f"datasets[0].message_property_mappings.{extra}", "freetx reads role and content"
        )
    columns = {k: str(v) for k, v in given.items() if DEFAULT_COLUMNS[fmt][k] != v}
    found.set("dataset.format", fmt)
    if columns:
        found.set("dataset.columns", columns)


def _preference_dataset(found: ImportedConfig, dataset_type: Any, entry: dict) -> None:
    """DPO's types: a chat template's prefix and the rows' layout (chatml.intel:
    {question, chosen, rejected}); chat_template.default's field names."""
    layout = str(dataset_type or "default").rsplit(".", 1)[-1]
    if layout not in PREFERENCE_COLUMNS:
        found.skip(
            "datasets[0].type",
            f"{dataset_type!r}: freetx's PreferenceDataset reads {{prompt, chosen, rejected}} "
            "(text or conversations); dataset.columns maps other names",
        )
        return
    columns = dict(PREFERENCE_COLUMNS[layout])
    for role in ("prompt", "chosen", "rejected"):
        if f"field_{role}" in entry:
            columns[role] = str(entry.pop(f"field_{role}"))
    if columns:
        found.set("dataset.columns", columns)

"""TRL's trainer configs read as freetx overrides (`freetx import trl`): an SFTConfig,
DPOConfig or GRPOConfig, with ModelConfig's PEFT keys and the `trl` scripts' dataset keys,
given as YAML or as the `trl` CLI's arguments (`trl_cli_args`). axolotl's configs use the
same HF Trainer and TRL names for most keys; freetx.planning.axolotl_import reads its own
and hands the rest to `map_trainer_keys` here.

The trainer kind picks the recipe: sft -> full_finetune_fsdp2 (lora_finetune_fsdp2 with
use_peft), dpo -> dpo_fsdp2, grpo -> grpo_fsdp2. What maps:

    model_name_or_path -> model_dir (a local HF folder; a Hub name is said)
    use_peft, load_in_4bit, lora_r / lora_alpha / lora_dropout / lora_target_modules,
    use_dora -> peft.* (load_in_4bit: peft.quantize_base=nf4, QLoRA)
    per_device_train_batch_size x gradient_accumulation_steps x --world-size -> batch_size
    (GRPO's counts completions: divided by num_generations, freetx's counts prompts)
    max_steps, or num_train_epochs x steps per epoch (--dataset-size) -> max_steps
    learning_rate, weight_decay, adam_*, optim, lr_scheduler_type, warmup_steps /
    warmup_ratio -> optimizer.*, lr_schedule.*
    bf16 / fp16, gradient_checkpointing, torch_compile, deepspeed, fsdp / fsdp_config ->
    distributed.* (a DeepSpeed file by freetx.planning.deepspeed_import)
    max_length, packing, max_prompt_length, dataset_name -> dataset.*, model.max_seq_len
    DPO's beta, loss_type, label_smoothing, rpo_alpha -> loss.*
    GRPO's beta, epsilon, epsilon_high, loss_type, scale_rewards, importance_sampling_level
    -> loss.*; num_generations, max_completion_length, temperature, top_p, top_k,
    steps_per_generation -> generation.*; TRL's built-in reward_funcs -> rewards

Every other key is listed with why.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from freetx.distributed.config import FSDP_SHARDING_STRATEGIES
from freetx.errors import FreetxError
from freetx.planning.deepspeed_import import import_deepspeed
from freetx.planning.fsdp_import import _fsdp_key
from freetx.planning.imported_config import (
    COUNT,
    EPOCHS,
    LORA_NUMBERS,
    QLORA_CONFIG,
    RATE,
    ImportedConfig,
    _flag,
    _mapping,
    _number,
    _seed_key,
    bad_value,
    family_configs,
    set_batch,
    set_dataset_source,
    set_epochs,
    set_model_dir,
    set_number,
    set_precision,
)

Keys = dict[str, tuple[str, Any]]  # TRL's name -> (the key as the file wrote it, its value)

TRAINERS = {"sft": "SFTConfig", "dpo": "DPOConfig", "grpo": "GRPOConfig"}
# kind -> (recipe without PEFT, with it) and (config without PEFT, with it); SFT's configs
# follow the model's family (freetx.planning.imported_config.family_configs)
RECIPES = {
    "sft": ("full_finetune_fsdp2", "lora_finetune_fsdp2"),
    "dpo": ("dpo_fsdp2", "dpo_fsdp2"),
    "grpo": ("grpo_fsdp2", "grpo_fsdp2"),
}
RL_CONFIGS = {
    "dpo": ("llm/qwen3_8b_dpo", "llm/llama3_1_8b_dpo_lora"),
    "grpo": ("llm/qwen3_8b_grpo", "llm/llama3_1_8b_grpo_lora"),
}
NO_RECIPE = {
    "kto": "freetx has no KTO recipe (unpaired completions labelled good or bad); pair them "
    "and train DPO (dpo_fsdp2)",
}
# keys only one trainer's config has: what decides a file's kind
KIND_KEYS = {
    "kto": ("desirable_weight", "undesirable_weight"),
    "grpo": ("num_generations", "reward_funcs", "max_completion_length", "epsilon",
             "epsilon_high", "reward_weights", "num_iterations", "use_vllm", "scale_rewards",
             "importance_sampling_level", "steps_per_generation", "generation_batch_size"),
    "dpo": ("beta", "max_prompt_length", "rpo_alpha", "label_smoothing", "reference_free",
            "precompute_ref_log_probs", "ref_model_init_kwargs", "sync_ref_model",
            "loss_type", "use_weighting", "f_divergence_type"),
}  # fmt: skip
LORA_KEYS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "use_dora")
OPTIMIZERS = {
    "adamw_torch": "torch.optim.AdamW",
    "adamw_torch_fused": "torch.optim.AdamW",
    "adamw_hf": "torch.optim.AdamW",
    "paged_adamw_32bit": "torch.optim.AdamW",
    "adamw_8bit": "torchao.optim.AdamW8bit",
    "adamw_bnb_8bit": "torchao.optim.AdamW8bit",
    "paged_adamw_8bit": "torchao.optim.AdamW8bit",
    "adamw_torch_4bit": "torchao.optim.AdamW4bit",
    "sgd": "torch.optim.SGD",
    "adagrad": "torch.optim.Adagrad",
    "rmsprop": "torch.optim.RMSprop",
}
# the HF Trainer's schedules -> (lr_schedule.decay, the lr it ends at: a ratio of the peak)
SCHEDULES = {
    "cosine": ("cosine", 0.0),
    "linear": ("linear", 0.0),
    "constant": ("constant", None),
    "constant_with_warmup": ("constant", None),
    "cosine_with_min_lr": ("cosine", None),  # lr_scheduler_kwargs' min_lr_rate
}
# the HF Trainer's sharding keys, upper-cased as accelerate's distributed_type (strategy
# names are freetx/distributed/'s alone)
SHARDING_KEYS = ("DEEPSPEED", "FSDP", "FSDP_CONFIG")
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust")  # freetx.objectives.PreferenceLoss's
GRPO_LOSSES = {"grpo": "sequence", "dr_grpo": "fixed", "dapo": "token", "bnpo": "token"}
SCALE_REWARDS = {True: "group", False: "none", "group": "group", "batch": "batch", "none": "none"}
# TRL's reward functions freetx has built in (trl.rewards.NAME or NAME)
TRL_REWARDS = {
    "accuracy_reward": {
        "_component_": "freetx.objectives.ExactMatch",
        "answer_field": "solution",
        "extract": "boxed",
    },
    "think_format_reward": {
        "_component_": "freetx.objectives.RegexFormat",
        "pattern": r"(?s)^<think>(?!.*<think>).*?</think>.*$",
    },
}
HUB = "freetx saves locally; `freetx checkpoint convert RUN DIR --to hf` writes an HF folder to upload"
LOGGING = (
    "freetx's metric_loggers (progress bar, JSONL, TensorBoard, WandB) are in the recipe's config"
)
VLLM = "freetx generates the completions with the policy itself (a KV cache), no vLLM server"
UNMAPPED = {
    "report_to": LOGGING,
    "run_name": LOGGING,
    "logging_dir": "freetx logs into output_dir (metrics.jsonl, tb/)",
    "logging_strategy": "freetx logs every log_every_n_steps",
    "save_strategy": "freetx saves every checkpoint.every_n_steps",
    "eval_strategy": "freetx evaluates every eval.every_n_steps",
    "per_device_eval_batch_size": "eval.batch_size is global, like batch_size",
    "overwrite_output_dir": "freetx never replaces saved work; resume=auto continues it",
    "resume_from_checkpoint": "an HF Trainer checkpoint; freetx resumes its own from "
    "output_dir (resume=auto) or resume=PATH",
    "push_to_hub": HUB,
    "hub_model_id": HUB,
    "hub_strategy": HUB,
    "hub_private_repo": HUB,
    "model_revision": "freetx reads the local folder model_dir as it is",
    "trust_remote_code": "freetx runs no code from a model folder",
    "attn_implementation": "freetx picks its attention kernel itself",
    "torch_dtype": "freetx computes in distributed.mixed_precision.param_dtype (bf16: true sets it)",
    "dtype": "freetx computes in distributed.mixed_precision.param_dtype (bf16: true sets it)",
    "tf32": "no TF32 switch in freetx; float32 matmuls use torch's default",
    "load_in_8bit": "freetx quantizes frozen bases to NF4 only (load_in_4bit: QLoRA)",
    "bnb_4bit_quant_type": "freetx's QLoRA bases are NF4",
    "use_bnb_nested_quant": "freetx's NF4 bases are quantized once (no double quantization)",
    "lora_task_type": "freetx trains causal language models",
    "lora_modules_to_save": "freetx trains the adapters only with peft.method=lora",
    "use_rslora": "freetx scales LoRA by alpha / rank (no rsLoRA)",
    "gradient_checkpointing_kwargs": "freetx recomputes whole blocks (no reentrant choice)",
    "dataset_config": "a subset of a Hub dataset: download that subset's files and set "
    "dataset.source=PATH",
    "dataset_train_split": "freetx reads the files of dataset.source (a train split)",
    "dataset_test_split": "freetx holds out dataset.val_fraction of the data for validation",
    "dataset_text_field": "freetx's plain-text dataset (dataset=freetx.data.PackedTextDataset) "
    "reads dataset.columns.text",
    "completion_only_loss": "freetx's chat and instruct datasets put the loss on the responses",
    "assistant_only_loss": "freetx's chat dataset puts the loss on the assistant's turns",
    "remove_unused_columns": "freetx reads the columns its format names",
    "data_seed": "freetx's seed orders the data too",
    "num_iterations": "freetx reuses a generation over generation.steps_per_generation steps; "
    "no repeated passes over one",
    "reference_free": "freetx's reference-free losses are loss.type=simpo or orpo",
    "sync_ref_model": "freetx's reference is fixed (the base, or a frozen copy)",
    "generation_batch_size": "freetx generates batch_size prompts x num_generations a step",
    "log_completions": "freetx logs sample completions every samples.every_n_steps",
    "mask_truncated_completions": "freetx scores truncated completions as they are",
    "use_vllm": VLLM,
}


def trainer_kind(data: dict) -> tuple[str, str]:
    """(sft, dpo, grpo or kto, how it was decided) from the keys a file has."""
    for kind, names in KIND_KEYS.items():
        present = [name for name in names if name in data]
        if present:
            return kind, f"a {kind.upper()} config: it has {', '.join(present)}"
    return "sft", "an SFT config: it has no DPO or GRPO key (beta, num_generations, ...)"


def check_kind(kind: str, source: str) -> None:
    if kind not in TRAINERS:
        why = NO_RECIPE.get(kind, f"{kind!r} is not a TRL trainer freetx imports")
        raise FreetxError(
            f"{source}: {why}. freetx imports TRL's sft, dpo and grpo configs: "
            "`freetx import trl FILE` (the kind from the file's keys) or `freetx import trl "
            "sft|dpo|grpo --config FILE ARGS...` (the trl CLI's arguments)."
        )


def trl_cli_args(kind: str, args: list[str]) -> dict:
    """The `trl sft|dpo|grpo` CLI's arguments (--name value, --name=value, --flag, --name
    a b c) as a config's keys; `--config FILE` is read first and the others win, as TRL
    does. Values are read as YAML scalars (1e-5, true, 8)."""
    import yaml

    from freetx.planning.config_import import read_config_file

    keys: dict[str, Any] = {}
    name = None
    for arg in args:
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            name = name.replace("-", "_")
            if not name:
                raise _usage(kind, arg)
            keys[name] = [value] if value else []
        elif name is None:
            raise _usage(kind, arg)
        else:
            keys[name].append(arg)
    values: dict[str, Any] = {}
    for name, given in keys.items():
        parsed = [yaml.safe_load(v) if v else v for v in given]
        values[name] = True if not parsed else parsed[0] if len(parsed) == 1 else parsed
    config = values.pop("config", None)
    if config is None:
        return values
    if not isinstance(config, str):
        raise _usage(kind, f"--config {config}")
    return {**read_config_file(config), **values}


def _usage(kind: str, arg: str) -> FreetxError:
    return FreetxError(
        f"`freetx import trl {kind}` read {arg!r} where a --name of the trl CLI goes; give "
        f"its arguments as `trl {kind}` takes them: --config FILE --model_name_or_path X "
        "--learning_rate 2e-5 ... (freetx's --world-size N and --dataset-size N too)."
    )


def import_trl(
    data: dict,
    kind: str | None = None,
    world_size: int | None = None,
    source: str = "the file",
    dataset_size: int | None = None,
) -> ImportedConfig:
    """What a TRL config means in freetx (the module docstring); `kind` None: from its
    keys, said in a note."""
    found = ImportedConfig(source=source)
    if kind is None:
        kind, how = trainer_kind(data)
        found.notes.append(
            f"trainer {kind}: {how} (to name it: freetx import trl sft|dpo|grpo --config FILE)"
        )
    check_kind(kind, source)
    keys = {str(name): (str(name), value) for name, value in data.items()}
    unknown = f"not a key of TRL's {TRAINERS[kind]} freetx maps"
    map_trainer_keys(found, kind, keys, world_size, dataset_size, unknown)
    return found


def map_trainer_keys(
    found: ImportedConfig,
    kind: str,
    keys: Keys,
    world_size: int | None,
    dataset_size: int | None,
    unknown: str,
) -> None:
    """TRL's keys (their names; the file's in messages) into `found`: the recipe and config
    to start from, the model, PEFT, batch and steps first, then each key; one not mapped
    is listed with `unknown` as its reason."""
    keys = {name: given for name, given in keys.items() if given[1] is not None}  # null: unset
    peft = _peft(found, keys)
    model = keys.pop("model_name_or_path", None)
    _start_from(found, kind, peft, "" if model is None else str(model[1]))
    if model is not None:
        set_model_dir(found, *model)
    else:
        found.notes.append("the file names no base model: set model_dir=HF_FOLDER (a local folder)")
    generations = keys.get("num_generations", ("", 8))  # TRL's default
    group = (generations[0] or "num_generations", generations[1]) if kind == "grpo" else None
    set_batch(
        found,
        keys.pop("per_device_train_batch_size", None),
        keys.pop("gradient_accumulation_steps", None),
        world_size,
        group,
    )
    _steps(found, keys, dataset_size)
    _betas(found, keys)
    if kind == "grpo":
        _rewards(found, keys.pop("reward_funcs", None), keys.pop("reward_weights", None))
    for name, (key, value) in keys.items():
        if not _trainer_key(found, kind, key, name, value):
            vllm = VLLM if name.startswith("vllm_") else None
            found.skip(key, UNMAPPED.get(name) or vllm or unknown)


def _peft(found: ImportedConfig, keys: Keys) -> str | None:
    """use_peft and LoRA's keys -> peft.*; "lora", "qlora" (load_in_4bit) or None."""
    use = keys.pop("use_peft", None)
    four_bit = keys.pop("load_in_4bit", None)
    qlora = four_bit is not None and _flag(found, *four_bit)
    if use is None or not _flag(found, *use):
        off = [keys.pop(name) for name in LORA_KEYS if name in keys]
        for key, _ in off + ([four_bit] if qlora and four_bit else []):
            found.skip(key, "use_peft is not true: every weight trains, as in the command")
        return None
    found.set("peft.method", "lora")
    if qlora:
        found.set("peft.quantize_base", "nf4")
    for name, target in zip(("lora_r", "lora_alpha", "lora_dropout"), LORA_NUMBERS):
        if name in keys:
            set_number(found, *keys.pop(name), target, LORA_NUMBERS[target])
    if "lora_target_modules" in keys:
        key, modules = keys.pop("lora_target_modules")
        modules = [modules] if isinstance(modules, str) else modules
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise bad_value(found, key, modules, "module names (q_proj, v_proj, ...) or all-linear")
        found.set("peft.target_modules", modules)
    if "use_dora" in keys:
        found.set("peft.use_dora", _flag(found, *keys.pop("use_dora")))
    return "qlora" if qlora else "lora"


def _start_from(found: ImportedConfig, kind: str, peft: str | None, model: str) -> None:
    if kind == "sft":
        (full, lora), _ = family_configs(model)
        config = QLORA_CONFIG if peft == "qlora" else lora if peft else full
    else:
        full, lora = RL_CONFIGS[kind]
        config = lora if peft else full
    found.recipe = RECIPES[kind][peft is not None]
    found.config = config


def _steps(found: ImportedConfig, keys: Keys, dataset_size: int | None) -> None:
    """max_steps (TRL's -1: unset) or epochs -> max_steps; then warmup_ratio of them."""
    steps = keys.pop("max_steps", None)
    epochs = keys.pop("num_train_epochs", None)
    if steps is not None and steps[1] != -1:
        set_number(found, *steps, "max_steps", (True, 1, 10**12))
        if epochs is not None:
            found.skip(epochs[0], "max_steps is set, and it wins over the epochs (as in TRL)")
    else:
        set_epochs(found, epochs, None, dataset_size, EPOCHS)
    ratio = keys.pop("warmup_ratio", None)
    if ratio is None:
        return
    share = _number(found, *ratio, (False, 0.0, 1.0))
    total = found.overrides.get("max_steps")
    if "warmup_steps" in keys:
        found.skip(ratio[0], "warmup_steps is set, and it wins over the ratio (as in TRL)")
    elif total is None:
        found.skip(
            ratio[0],
            f"{share}: a share of the run's steps, which the file does not fix; set "
            "lr_schedule.warmup_steps (give --dataset-size N and --world-size N for epochs)",
        )
    elif share:
        found.set("lr_schedule.warmup_steps", math.ceil(share * total))
        found.notes.append(
            f"lr_schedule.warmup_steps={math.ceil(share * total)}: {share} x {total}"
        )


def _betas(found: ImportedConfig, keys: Keys) -> None:
    """adam_beta1 / adam_beta2 -> optimizer.betas (the HF Trainer's 0.9, 0.999 for the other)."""
    one, two = keys.pop("adam_beta1", None), keys.pop("adam_beta2", None)
    if one is None and two is None:
        return
    betas = [
        0.9 if one is None else _number(found, *one, (False, 0.0, 0.999999)),
        0.999 if two is None else _number(found, *two, (False, 0.0, 0.999999)),
    ]
    found.set("optimizer.betas", betas)


def _rewards(
    found: ImportedConfig, functions: tuple[str, Any] | None, weights: tuple[str, Any] | None
) -> None:
    """TRL's built-in reward functions -> freetx's; a function of your own is listed (TRL's
    score batches, freetx's one completion: docs/rewards.md)."""
    if functions is None:
        return
    key, names = functions
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise bad_value(found, key, names, "reward function names (trl.rewards.accuracy_reward)")
    weights_key, given = weights or ("reward_weights", [1.0] * len(names))
    if not isinstance(given, list) or len(given) != len(names):
        raise bad_value(found, weights_key, given, f"a list of {len(names)} numbers")
    rewards = []
    for i, (name, weight) in enumerate(zip(names, given)):
        short = name.removeprefix("trl.rewards.")
        if short not in TRL_REWARDS:
            found.skip(
                f"{key}[{i}]",
                f"{name}: TRL's reward functions score batches (prompts, completions, **columns) -> "
                "list of floats; a freetx reward scores one: f(prompt, completion, row) -> "
                "float. Wrap it and set rewards=[{_component_: my_rewards.NAME}] (the "
                "config's own rewards stay until then; docs/rewards.md)",
            )
            continue
        node = dict(TRL_REWARDS[short])
        if weight != 1.0:
            node["weight"] = _number(found, weights_key, weight, RATE)
        rewards.append(node)
        found.notes.append(f"reward {name} -> {node['_component_']}")
    if rewards:
        found.set("rewards", rewards)


def _trainer_key(found: ImportedConfig, kind: str, key: str, name: str, value: Any) -> bool:
    """One TRL key (`name`, written `key` in the file); False when it maps to nothing."""
    if name == "output_dir":
        found.set("output_dir", str(value))
    elif name == "seed":
        set_number(found, key, value, "seed", (True, 0, 2**32 - 1))
    elif name == "adam_epsilon":
        set_number(found, key, value, "optimizer.eps", RATE)
    elif name == "optim":
        _optimizer(found, key, value)
    elif name == "lr_scheduler_type":
        _schedule(found, key, value)
    elif name == "lr_scheduler_kwargs":
        kwargs = dict(_mapping(found, key, value))
        if "min_lr_rate" in kwargs:
            ratio = kwargs.pop("min_lr_rate")
            set_number(
                found, f"{key}.min_lr_rate", ratio, "lr_schedule.min_lr_ratio", (False, 0, 1)
            )
        for rest in kwargs:
            found.skip(f"{key}.{rest}", "freetx's schedule takes min_lr_ratio only")
    elif name in ("bf16", "fp16"):
        if value is True or (name == "bf16" and value == "auto"):  # axolotl's auto: bf16
            set_precision(found, key, name)
        elif value is not False and value is not None:
            raise bad_value(found, key, value, "true or false")
    elif name == "gradient_checkpointing":
        on = value not in (False, None)  # axolotl: true, "unsloth", "offload"
        found.set("distributed.activation_checkpointing", "full" if on else "none")
    elif name == "torch_compile":
        found.set("distributed.compile", _flag(found, key, value))
    elif name == "logging_steps":
        set_number(found, key, value, "log_every_n_steps", COUNT)
    elif name == "save_steps":
        set_number(found, key, value, "checkpoint.every_n_steps", COUNT)
    elif name == "save_total_limit":
        set_number(found, key, value, "checkpoint.keep_last", COUNT)
    elif name == "eval_steps":
        set_number(found, key, value, "eval.every_n_steps", COUNT)
    elif name == "dataset_name":
        set_dataset_source(found, key, value)
    elif name in ("max_length", "max_seq_length"):
        _sequence_length(found, kind, key, value)
    elif name == "packing" and kind != "grpo":
        found.set("dataset.packed", _flag(found, key, value))
    elif name == "max_prompt_length" and kind != "sft":
        set_number(found, key, value, "dataset.max_prompt_len", COUNT)
    elif name.upper() in SHARDING_KEYS:
        _sharding(found, key, name.upper(), value)
    elif kind == "dpo" and _dpo_key(found, key, name, value):
        pass
    elif kind == "grpo" and _grpo_key(found, key, name, value):
        pass
    else:
        return name not in UNMAPPED and _seed_key(found, key, name, value)
    return True


def _sequence_length(found: ImportedConfig, kind: str, key: str, value: Any) -> None:
    """A sample's tokens -> dataset.seq_len (GRPO: none) and the model's RoPE tables."""
    length = _number(found, key, value, COUNT)
    if kind != "grpo":
        found.set("dataset.seq_len", length)
    found.set("model.max_seq_len", length)


def _optimizer(found: ImportedConfig, key: str, value: Any) -> None:
    component = OPTIMIZERS.get(str(value).lower())
    if component is None:
        found.skip(
            key,
            f"{value!r}: name a torch optimizer in optimizer._component_ (torch.optim.AdamW, "
            "torchao.optim.AdamW8bit)",
        )
        return
    found.set("optimizer._component_", component)
    if str(value).startswith("paged_"):
        found.notes.append(
            f"{key} {value}: freetx pages no optimizer states; optimizer.offload=cpu keeps them "
            "on the CPU"
        )


def _schedule(found: ImportedConfig, key: str, value: Any) -> None:
    schedule = SCHEDULES.get(str(value).lower())
    if schedule is None:
        found.skip(
            key, f"{value!r}: freetx's lr_schedule is warmup, then cosine, linear or constant decay"
        )
        return
    found.set("lr_schedule.decay", schedule[0])
    if schedule[1] is not None:
        found.overrides.setdefault("lr_schedule.min_lr_ratio", schedule[1])


def _sharding(found: ImportedConfig, key: str, name: str, value: Any) -> None:
    """A DeepSpeed file (read by `freetx import deepspeed`'s mapping), FSDP's options
    ("full_shard auto_wrap") and its fsdp_config section."""
    if name == "DEEPSPEED":
        from freetx.planning.config_import import read_config_file

        if isinstance(value, dict):
            import_deepspeed(found, value, None)
        elif isinstance(value, str) and Path(value).expanduser().is_file():
            import_deepspeed(found, read_config_file(value), None)
            found.notes.append(f"{key} {value}: read as `freetx import deepspeed {value}` does")
        else:
            found.skip(key, f"{value}: not a file here; run `freetx import deepspeed FILE` on it")
    elif name == "FSDP":
        options = value.split() if isinstance(value, str) else value
        if not isinstance(options, list):
            raise bad_value(found, key, value, "FSDP options, e.g. full_shard auto_wrap")
        for option in options:
            strategy = FSDP_SHARDING_STRATEGIES.get(str(option).upper())
            if strategy is not None:
                found.set("distributed.strategy", strategy)
            elif option == "offload":
                found.set("distributed.cpu_offload", True)
            elif option != "auto_wrap":  # what freetx does anyway: one block at a time
                found.skip(f"{key}: {option}", "not an FSDP option freetx maps")
    elif isinstance(value, str):
        found.skip(key, f"an FSDP file: run `freetx import fsdp-config {value}`")
    else:
        for option, setting in _mapping(found, key, value).items():
            short = option if option.startswith("fsdp_") else f"fsdp_{option}"
            if not _fsdp_key(found, f"{key}.{option}", short, setting):
                found.skip(f"{key}.{option}", "not an FSDP key freetx maps")


def _dpo_key(found: ImportedConfig, key: str, name: str, value: Any) -> bool:
    if name == "beta":
        set_number(found, key, value, "loss.beta", (False, 0.0, 1e6))
    elif name == "loss_type":
        if value not in DPO_LOSSES:
            found.skip(
                key, f"{value!r}: freetx's DPO losses are {', '.join(DPO_LOSSES)}, simpo, orpo"
            )
        else:
            found.set("loss.type", value)
    elif name == "label_smoothing":
        set_number(found, key, value, "loss.label_smoothing", (False, 0.0, 0.5))
    elif name == "rpo_alpha":
        set_number(found, key, value, "loss.rpo_alpha", (False, 0.0, 1e6))
    elif name == "precompute_ref_log_probs":
        found.set("reference.precompute", _flag(found, key, value))
    else:
        return False
    return True


def _grpo_key(found: ImportedConfig, key: str, name: str, value: Any) -> bool:
    if name == "beta":
        set_number(found, key, value, "loss.beta", (False, 0.0, 1e6))
    elif name in ("epsilon", "epsilon_high"):
        target = "loss.epsilon_low" if name == "epsilon" else "loss.epsilon_high"
        set_number(found, key, value, target, (False, 0.0, 10.0))
    elif name == "loss_type":
        if not isinstance(value, str) or value not in GRPO_LOSSES:
            found.skip(key, f"{value!r}: freetx's GRPO losses are {', '.join(GRPO_LOSSES)}")
        else:
            found.set("loss.aggregation", GRPO_LOSSES[value])
    elif name == "scale_rewards":
        if not isinstance(value, (str, bool)) or value not in SCALE_REWARDS:
            raise bad_value(found, key, value, "true, false, group, batch or none")
        found.set("loss.scale_rewards", SCALE_REWARDS[value])
    elif name == "importance_sampling_level":
        if value not in ("token", "sequence"):
            raise bad_value(found, key, value, "token or sequence")
        found.set("loss.importance_sampling", value)
    elif name in ("num_generations", "steps_per_generation"):
        set_number(found, key, value, f"generation.{name}", COUNT)
    elif name == "max_completion_length":
        set_number(found, key, value, "generation.max_completion_length", COUNT)
    elif name in ("temperature", "top_p"):
        set_number(found, key, value, f"generation.{name}", (False, 0.0, 100.0))
    elif name == "top_k":
        if value not in (None, 0, -1):  # TRL's "every token"
            set_number(found, key, value, "generation.top_k", COUNT)
    else:
        return False
    return True

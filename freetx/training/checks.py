"""Checks made before training: that a run's config fits the processes it runs on
(`check_layout`), and that a model, its tokenizer and its data fit together."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from freetx.checkpoint.run_folder import check_output_dir
from freetx.config.instantiate import find_components, instantiate, node_config, to_container
from freetx.config.run_config import loaded_config_file
from freetx.data import micro_batch_size, tokenizer_problem
from freetx.data.sources import source_problems
from freetx.distributed import DistributedConfig, MeshShape, Processes, check_distributed
from freetx.distributed.context_parallel import check_shards_context
from freetx.distributed.expert_parallel import check_expert_parallel
from freetx.distributed.optimizer import check_optimizer
from freetx.distributed.pipeline import check_micro_batches, check_stages, num_stages, stage_blocks
from freetx.distributed.tensor_parallel import check_slices
from freetx.errors import CheckpointError, ConfigError, FreetxError
from freetx.fields import read_paths, written_folders
from freetx.models.decoder.config import TransformerConfig
from freetx.models.decoder.tensor_parallel import check_tensor_parallel
from freetx.models.hf import read_hf_config, text_model_config
from freetx.models.peft import ALL_LINEAR, PEFTConfig, check_nf4_experts_slices
from freetx.models.peft.experts import (
    expert_modules,
    expert_option_problems,
    refuse_expert_options,
)
from freetx.models.peft.lora import check_dora_slices
from freetx.models.protocol import DescribesItself, PacksDocuments
from freetx.training.config import PlannedRun, TrainingConfig, check_per_rank_forwards
from freetx.training.export import built_class, check_final_export
from freetx.user_files import check_writable_folder


def check_layout(cfg: object, processes: Processes) -> None:
    """Every refusal of a training config's layout, made with what `processes` knows: the
    `distributed:` section (strategy, dtype, offload, hsdp mesh), the split of the
    global batch over the data-parallel ranks x accumulation steps, and
    `checkpoint.final_export` (`check_final_export`). `freetx validate`,
    `freetx run` and `freetx launch` (before they launch anything) and `freetx estimate`
    call it; a running recipe makes the same checks (`build_groups`, `micro_batch_size`)."""
    if not isinstance(cfg, TrainingConfig):  # e.g. generate: nothing is distributed
        return
    shape = check_distributed(cfg.distributed, processes)
    check_optimizer(
        cfg.optimizer,
        cfg.distributed,
        processes,
        cfg.gradient_accumulation_steps,
        cfg.max_grad_norm,
    )
    cfg.refuse_combinations()  # the schema's own
    check_per_rank_forwards(cfg, shape.ep)  # eval.after_training's lm-eval scoring
    planned = cfg.planned() or PlannedRun(None)  # None: the schema names no model or data
    model_class = built_class(planned.model)
    check_final_export(cfg, model_class)
    tokenizer_class = built_class(planned.tokenizer, "tokenizer")
    if tokenizer_class is not None and tokenizer_problem(tokenizer_class):
        raise ConfigError(tokenizer_problem(tokenizer_class))
    dataset = planned.dataset if isinstance(planned.dataset, DictConfig) else None
    if model_class is not None and dataset is not None:
        packed = any(node.get("packed", False) for node in dataset_nodes(dataset))
        check_packing(model_class, bool(packed))
    if cfg.distributed.tp > 1 and model_class is not None:
        check_slices(model_class)
    check_model_shape(cfg.distributed, planned.adapters, node_config(planned.model))
    check_adapted_experts(planned.adapters, planned.model)
    check_micro_batches(cfg.distributed, cfg.gradient_accumulation_steps)
    if cfg.distributed.pp > 1 and model_class is not None:
        check_stages(model_class)
    if cfg.distributed.cp > 1 and model_class is not None:  # the dataset's seq_len, if any
        check_context(model_class, shape, planned.seq_len if dataset is not None else None)
    if processes.world_size is not None:  # pipeline, context, tensor ranks read the same data
        micro_batch_size(cfg.batch_size, shape.dp, cfg.gradient_accumulation_steps)


def check_model_shape(dist: DistributedConfig, peft: object, shape: object) -> None:
    """The refusals a run makes of its model's shape when it parallelizes it, made from
    the model node's config (`shape`: a native decoder's; None: known only once built):
    tp slices its heads (`check_tensor_parallel`), pp splits its blocks into stages
    (`stage_blocks`), ep spreads its experts (`check_expert_parallel`); and a DoRA run, or
    QLoRA on experts, is refused with tp (`check_dora_slices`, `check_nf4_experts_slices`),
    QLoRA on experts with ep too (`peft`: the adapters' section, None: none)."""
    if dist.tp > 1 and isinstance(peft, PEFTConfig) and peft.method == "lora":
        check_dora_slices(peft.use_dora)
        check_nf4_experts_slices(peft, "tp")
    if dist.ep > 1 and isinstance(peft, PEFTConfig):
        check_nf4_experts_slices(peft, "ep")
    if not isinstance(shape, TransformerConfig):
        return
    if dist.tp > 1:
        check_tensor_parallel(shape, dist.tp)
    if dist.pp > 1:
        stage_blocks(shape.num_layers, num_stages(dist), dist.pp_blocks_per_stage)
    if dist.ep > 1:
        check_expert_parallel(shape.num_experts, dist.ep, "the model")


def check_adapted_experts(peft: object, node: Any) -> None:
    """LoRA on all-linear adapts an MoE model's experts too, which take no dropout and no
    DoRA: the refusal the ranks make when they apply the adapters
    (`refuse_expert_options`), made before launch from the model node built on the meta
    device, where it can matter (`peft`: the adapters' section, None: none). A node that
    does not build is left to the run, which says why."""
    if not isinstance(peft, PEFTConfig) or peft.method != "lora":
        return
    if ALL_LINEAR not in peft.target_modules or not isinstance(node, DictConfig):
        return
    if not expert_option_problems(peft.dropout, peft.use_dora):
        return
    try:
        with torch.device("meta"):
            model = instantiate(node)
    except FreetxError:
        return
    if expert_modules(model):
        refuse_expert_options(peft.dropout, peft.use_dora)


def model_vocab_size(node: Any) -> int | None:
    """The vocabulary of the model a node builds, known before anything is built (from
    its keys over its preset's, or an HF folder's config.json: `path`); None when the node
    does not say (or its folder cannot be read: building it says why)."""
    if not isinstance(node, DictConfig):
        return None
    try:
        path, size = node.get("path"), node.get("vocab_size")
    except OmegaConfBaseException:  # an interpolation of a key still ???
        return None
    if isinstance(size, int):  # over its preset's and its folder's
        return size
    if isinstance(path, str):
        try:
            return text_model_config(read_hf_config(path)).get("vocab_size")
        except CheckpointError:
            return None
    return getattr(node_config(node), "vocab_size", None)


def dataset_nodes(dataset: DictConfig) -> list[DictConfig]:
    """The dataset nodes a `dataset:` section builds: itself, or a mixture's sources."""
    sources = dataset.get("sources")
    if isinstance(sources, ListConfig) and all(isinstance(s, DictConfig) for s in sources):
        return list(sources) or [dataset]
    return [dataset]


def holds_validation(dataset: Any) -> bool:
    """Whether a `dataset:` section has validation rows: a source (a mixture's, any) with a
    `validation_source`, or a `val_fraction` that is not 0 (unset: the dataset's default)."""
    if not isinstance(dataset, DictConfig):
        return True
    return any(
        node.get("validation_source") is not None or node.get("val_fraction") != 0
        for node in dataset_nodes(dataset)
    )


def dataset_seq_len(cfg) -> int:
    """A training config's sequence length: its dataset's `seq_len` (a mixture's first
    source's: they must agree), else the model's max_seq_len, else 2048."""
    node = dataset_nodes(cfg.dataset)[0]
    return int(node.get("seq_len", cfg.model.get("max_seq_len", 2048)))


def check_model_and_data(
    model_config, tokenizer, seq_len: int, seq_key: str = "dataset.seq_len"
) -> None:
    """The tokenizer's ids fit the embedding; sequences fit the positional tables
    (`seq_key`: what the config calls their length)."""
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding has "
            f"{model_config.vocab_size} rows, so some token ids have no embedding.",
            fix=f"Set model.vocab_size={tokenizer.vocab_size} (or larger), or use the tokenizer "
            "the model was made for.",
        )
    if seq_len > model_config.max_seq_len:
        raise ConfigError(
            f"{seq_key}={seq_len} is longer than the model's max_seq_len="
            f"{model_config.max_seq_len}.",
            fix=f"Lower {seq_key}, or set model.max_seq_len={seq_len}.",
        )


def class_of(model: nn.Module | type) -> type:
    """The class of a model built (on the meta device) or the class a config builds."""
    return model if isinstance(model, type) else type(model)


def described(model: nn.Module | type) -> str:
    """A model in words for a refusal: what it says of itself, else its class's name."""
    if not isinstance(model, type) and isinstance(model, DescribesItself):
        return model.describe()
    return class_of(model).__name__


def check_packing(model: nn.Module | type, packed: bool) -> None:
    """A packed dataset (several samples per sequence; `packed`) needs a model that
    keeps them apart (`PacksDocuments`). `model`: the model built (on the meta device,
    by the recipe) or the class a config builds (`check_layout`: validate, run, launch)."""
    if not packed or issubclass(class_of(model), PacksDocuments):
        return
    raise ConfigError(
        f"dataset.packed=true puts several samples in each sequence, and the model ({described(model)}) "
        "cannot keep them apart: its forward takes no document boundaries, so every sample "
        "would attend to the samples before it and read their positions.",
        fix="Set dataset.packed=false, or train a native freetx decoder (freetx.models.decoder, "
        "or freetx.models.hf_model on a family freetx reads natively), which packs.",
    )


def check_context(model: nn.Module | type, shape: MeshShape, seq_len: int | None = None) -> None:
    """distributed.cp > 1 needs a model that computes a part of each sequence as the whole
    sequence would (`ShardsContext`; `model`: the model built, or the class a config
    builds) and sequences that split into 2 x cp chunks (`seq_len`, where known)."""
    if shape.cp == 1:
        return
    if seq_len is not None:
        shape.check_sequence_length(seq_len)
    check_shards_context(model)


def check_read_paths(cfg: object) -> None:
    """Every file or folder a config names for the run to read (`read_path` fields:
    model_dir) exists: checked before anything is launched (`freetx run`, `freetx
    validate`), so a typo costs no start-up and is not reported as another key's problem."""
    if not dataclasses.is_dataclass(cfg):
        return
    for where, node in _component_nodes(cfg):
        if "source" in node and not OmegaConf.is_missing(node, "source"):
            source = to_container(node.source)
            for why in source_problems({"source": source}).values():
                raise ConfigError(f"{where}.source: {why}")
    for key, path in read_paths(cfg):
        if path and path != "???" and not Path(path).expanduser().exists():
            raise ConfigError(
                f"{key}={path} does not exist.",
                fix=f"Point {key} at what the run reads (an HF model folder, a run's "
                "output_dir, a DCP folder or a .safetensors file); a run's output_dir is "
                "there once that run has saved a checkpoint.",
            )


def _component_nodes(cfg: object, path: str = "") -> list[tuple[str, DictConfig]]:
    """Every `_component_` node of a schema instance (in its sections too), with its key."""
    found = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name, None)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            found.extend(_component_nodes(value, f"{path}{f.name}."))
        elif isinstance(value, (DictConfig, ListConfig)):
            found.extend(find_components(value, f"{path}{f.name}"))
    return found


def check_written_folders(cfg: object) -> None:
    """Every folder a config has a command write into (`written_folder` fields: output_dir,
    caches, data folders) can be written: made before anything is launched (`freetx run`,
    `freetx validate`), so a read-only disk costs no start-up."""
    if dataclasses.is_dataclass(cfg):
        for key, folder, own in written_folders(cfg):
            check_writable_folder(folder, key, own)
            if key == "output_dir":  # a run's folder: never one taken over
                check_output_dir(folder, loaded_config_file())

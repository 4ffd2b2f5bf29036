"""A training config's estimate (`freetx estimate`): what its schema says it trains
(`TrainingConfig.planned`) built on the meta device, under the run's own checks, counted
per strategy by `freetx.planning.estimate`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from freetx.checkpoint.loading import source_parameters
from freetx.config import instantiate
from freetx.data import micro_batch_size
from freetx.distributed import Processes
from freetx.distributed.config import strategy_shapes
from freetx.distributed.optimizer import check_optimizer
from freetx.distributed.parallelize import find_blocks
from freetx.distributed.pipeline import check_stages, num_stages, rank_stages, stage_blocks
from freetx.errors import ConfigError
from freetx.models.chunked_loss import CHUNKS_FOR_LARGE_VOCABULARY as CHUNKS
from freetx.models.protocol import check_model
from freetx.planning.estimate import GenerationPhase, estimate, pipeline_stage_shapes
from freetx.planning.rungs import Rungs
from freetx.planning.sources import ActivationSources, activation_sources
from freetx.training import PlannedRun, TrainingConfig


@dataclasses.dataclass
class ConfigEstimate:
    """`estimate_config`'s answer: the meta model, the micro-batch per rank (sequences of
    `seq_len` tokens; a crosscoder's rows: 1), a row per strategy a run would accept, why
    it refuses the rest, and a crosscoder's sources (None for other models)."""

    model: Any
    micro: int
    seq_len: int
    rows: list  # freetx.planning.estimate.Estimate
    refused: dict[str, str]
    sources: ActivationSources | None = None
    shapes: list = dataclasses.field(default_factory=list)  # MeshShape, per strategy estimated
    planned: PlannedRun = dataclasses.field(default_factory=lambda: PlannedRun(None))
    judges: float = (
        0.0  # bytes per rank: the weights of judge rewards' models (`PlannedRun.judges`)
    )


def estimate_config(
    cfg: Any,
    world_size: int,
    device: str,
    mfu: float = 0.4,
    replicas: int = 1,
    source_dim: int | None = None,
    chunked: bool | None = None,
) -> ConfigEstimate:
    """The analytic estimate of a training config (a schema instance) at `world_size` ranks
    of `device` (a key of freetx.planning.estimate.DEVICES), under the run's own checks: a
    batch that does not split refuses it all; a strategy that a run would refuse gets no
    row (the `optimizer:` node's rungs too: `check_optimizer`). A crosscoder's config
    (`activations:`) is estimated with its source models (`activation_sources`;
    `source_dim`: its hooked width where they cannot be read). `chunked`: the loss's
    logits in chunks (the config's num_chunks above 1, else 8: the default for large
    vocabularies) or not (num_chunks 1); None: as the config says."""
    planned = planned_run(cfg)
    processes = Processes(world_size, device_type="cpu" if device == "cpu" else "cuda")
    # replicas: hsdp's replicate degree (the other strategies ignore it)
    shapes, refused = strategy_shapes(cfg.distributed, processes, replicas)
    shapes = optimizer_shapes(cfg, shapes, refused, processes)
    data_ranks = shapes[0].dp if shapes else world_size  # a pp x cp x tp group reads one share
    micro = micro_batch_size(cfg.batch_size, data_ranks, cfg.gradient_accumulation_steps)
    sources = None
    if planned.activations is not None:  # a crosscoder: rows of its sources' activations
        sources = activation_sources(planned.activations, device, source_dim)
        model = meta_model(
            planned.model, num_sources=sources.num_sources, source_dim=sources.source_dim
        )
    else:
        model = meta_model(planned.model, planned.adapters)
    seq_len = planned.seq_len or model.config.max_seq_len  # AD's windows: the model's context
    dist = cfg.distributed
    chunks = planned.loss.get("num_chunks") if planned.loss is not None else None
    if chunked is not None:
        chunks = (chunks if chunks and int(chunks) > 1 else CHUNKS) if chunked else 1
    rungs = Rungs.of(cfg)

    # a judge reward's model: whole while it scores, bfloat16 on a GPU, float32 on the CPU
    judges = sum(map(source_parameters, planned.judges)) * (4 if device == "cpu" else 2)
    generation = None
    if planned.generations_per_prompt:  # online RL: this rank's completions of one generation
        rows = cfg.batch_size // data_ranks * planned.generations_per_prompt
        generation = GenerationPhase(rows, seq_len, planned.engine)

    def rows_of(part, stage=None):
        return estimate(
            part,
            shapes,
            micro * planned.rows_per_sample * seq_len,
            seq_len,
            dist.mixed_precision.param_dtype,
            dist.activation_checkpointing,
            dist.ac_every_n_blocks,
            device,
            mfu,
            sources=(sources.bytes if sources else 0.0) + judges,
            rungs=rungs,
            loss_chunks=int(chunks) if chunks else None,
            stage=stage,
            sequence_parallel=dist.sequence_parallel and dist.pp == 1,
            reference=planned.reference,
            generation=generation,
        )

    if dist.pp == 1:
        rows = rows_of(model)
    else:  # the first stage (most micro-batches in flight) or the last (the loss): the fuller
        stages = pipeline_stage_shapes(dist, cfg.gradient_accumulation_steps)
        staged = [
            rows_of(stage_model(planned, dist, end), shape)
            for end, shape in zip(("first", "last"), stages)
        ]
        rows = [max(pair, key=lambda r: r.peak) for pair in zip(*staged)]
    return ConfigEstimate(model, micro, seq_len, rows, refused, sources, shapes, planned, judges)


def optimizer_shapes(cfg: Any, shapes: list, refused: dict[str, str], processes: Processes):
    """The `shapes` whose strategy the `optimizer:` node's rungs take (`check_optimizer`),
    the others' reasons added to `refused`; a refusal of every strategy is raised."""
    kept, first = [], None
    for shape in shapes:
        try:
            check_optimizer(
                cfg.optimizer,
                dataclasses.replace(cfg.distributed, strategy=shape.strategy),
                processes,
                cfg.gradient_accumulation_steps,
                cfg.max_grad_norm,
            )
            kept.append(shape)
        except ConfigError as e:
            first = first or e
            refused[shape.strategy] = e.problems[0]
    if shapes and not kept:
        raise first
    return kept


def stage_model(planned: PlannedRun, dist: Any, end: str):
    """The meta model of the pipeline rank holding the first or the last stage."""
    model = meta_model(planned.model, planned.adapters)
    check_stages(model)
    num_blocks = len(find_blocks(model))
    blocks = stage_blocks(num_blocks, num_stages(dist), dist.pp_blocks_per_stage)
    rank = 0 if end == "first" else dist.pp - 1
    mine = [blocks[s] for s in rank_stages(rank, dist.pp, dist.pp_stages_per_rank)]
    model.keep_blocks(
        sorted(i for stage in mine for i in stage),
        first=rank == 0,
        last=mine[-1].stop == num_blocks,
    )
    return model


def planned_run(cfg: Any) -> PlannedRun:
    """What a training config trains (its schema's `planned`); a config without a model or
    a training batch (generate's) has nothing to estimate."""
    planned = cfg.planned() if isinstance(cfg, TrainingConfig) else None
    if planned is None:
        raise ConfigError(
            "freetx estimate reads training configs (a model and a batch_size); this one "
            "trains nothing.",
            fix="Give a training config: full_finetune_fsdp2, lora_finetune_fsdp2, ad_ddp or "
            "crosscoder_fsdp2's.",
        )
    return planned


def meta_model(model_node, peft_cfg=None, **fields):
    """The config's model on the meta device (with its adapters when it has `peft`);
    `fields`: the model's fields the recipe gives from its data (a crosscoder's shape)."""
    with torch.device("meta"):
        model = instantiate(model_node, **fields)
        check_model(model)
        if peft_cfg is not None:
            from freetx.models.peft import apply_peft

            apply_peft(model, peft_cfg)
    return model

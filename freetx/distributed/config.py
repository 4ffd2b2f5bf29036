"""The `distributed:` section every recipe shares (`DistributedConfig`), the dtype and
strategy names it takes (and other systems' names for the strategies, for `freetx
import`), and every refusal of it (`check_distributed`), made with what is known of the
processes before anything is built: by `freetx validate`, `run`, `launch` and `estimate`
alike, and by the run itself (`build_groups`). Apart from `parallelize`, which applies
the section: the checks need none of FSDP2, DDP or the model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch

from freetx.distributed.float8 import check_float8
from freetx.distributed.mesh import SHARDED, MeshShape, Processes, canonical_strategy
from freetx.distributed.pipeline import num_stages
from freetx.errors import ConfigError
from freetx.fields import at_least

# every dtype name a config or a command line uses, in both spellings
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ABBREVIATIONS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# other systems' names for the strategies (`freetx import`): DeepSpeed's ZeRO stages,
# FSDP1's ShardingStrategy (by name, or the number accelerate writes), accelerate's
# distributed_type, and FSDP2's reshard_after_forward (False keeps blocks gathered)
ZERO_STAGE_STRATEGIES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}
FSDP_SHARDING_STRATEGIES = {
    "FULL_SHARD": "fsdp",
    "SHARD_GRAD_OP": "zero2",
    "NO_SHARD": "ddp",
    "HYBRID_SHARD": "hsdp",
    "1": "fsdp",
    "2": "zero2",
    "3": "ddp",
    "4": "hsdp",
}
RESHARD_AFTER_FORWARD_STRATEGIES = {True: "fsdp", False: "zero2"}
DATA_PARALLEL_STRATEGY = "ddp"  # accelerate's MULTI_GPU / MULTI_CPU

DtypeName = Literal["float32", "bfloat16", "float16"]


@dataclass
class MixedPrecisionConfig:
    """Parameter (compute) and gradient-reduction dtypes. float32/float32 is off."""

    param_dtype: DtypeName = "float32"
    reduce_dtype: DtypeName = "float32"


@dataclass
class DistributedConfig:
    """The `distributed:` section every recipe shares."""

    strategy: Literal["fsdp", "zero3", "zero2", "zero1", "ddp", "hsdp"] = "fsdp"
    # hsdp: number of replicas (shards = world size / replicas). None: one per node.
    replicate_degree: Optional[int] = at_least(1, default=None)
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    cpu_offload: bool = False
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    ac_every_n_blocks: int = at_least(1, default=2)  # selective: checkpoint every n-th block
    # the activations a forward saves for backward moved to pinned host memory as they
    # are saved (a side CUDA stream), brought back ahead of the backward's need; with
    # activation checkpointing, only the blocks' inputs (freetx.distributed.
    # activation_offload); on the CPU the same hooks keep them where they are; not pp > 1
    activation_offloading: bool = False
    # the blocks' Linears in float8 (torchao.float8; CUDA capability 8.9+: H100 and
    # later): tensorwise scales (under FSDP2 the weights all-gathered in float8) or
    # rowwise ones (closer to bf16, slower); none: the compute dtype (freetx.
    # distributed.float8); not with tp > 1
    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    compile: bool = False
    # tensor parallelism: each block's attention and MLP sliced over this many ranks (with
    # fsdp or zero2 over the others: a (dp, tp) mesh); 1: none
    tp: int = at_least(1, default=1)
    # with tp > 1: the residual stream between the sliced layers, and its norms, sliced by
    # sequence too (gathered before attention and the MLP, reduce-scattered after), so a
    # rank keeps 1/tp of them; not with pp > 1 (stages pass whole hidden states)
    sequence_parallel: bool = True
    # with tp > 1 on CUDA, compiled blocks: Inductor splits tp's all-gathers and
    # reduce-scatters into pieces overlapped with the matmuls that use them (symmetric
    # memory; torchtitan's async TP)
    async_tp: bool = False
    # context parallelism: each sequence split over this many ranks, attention over the
    # whole sequence (keys and values gathered); fsdp or zero2 shards over dp x cp; 1: none
    cp: int = at_least(1, default=1)
    # pipeline parallelism: the blocks split into stages of consecutive blocks over this
    # many ranks (fsdp or zero2 within each stage), the micro-batches of an optimizer step
    # (gradient_accumulation_steps) through them by `pp_schedule`; 1: none
    pp: int = at_least(1, default=1)
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe"] = "1f1b"
    pp_stages_per_rank: int = at_least(1, default=1)  # interleaved_1f1b: 2 or more
    # blocks per stage, first to last (pp x pp_stages_per_rank of them); None: as even as
    # the blocks divide
    pp_blocks_per_stage: Optional[list[int]] = None
    # expert parallelism: each MoE block's experts spread over this many data-parallel
    # ranks (num_experts / ep whole experts each), tokens sent to their experts and back
    # by all-to-all, dropless; FSDP2 shards the experts over the other dp / ep x cp ranks
    # and everything else over dp x cp as without it (fsdp, zero2 or hsdp: within each
    # replica; with pp, within each stage; freetx.distributed.expert_parallel); 1: none
    ep: int = at_least(1, default=1)
    # a collective that a rank does not reach within this ends the job with a message
    # naming the step (the hang guard); large saves and evaluations must fit inside it
    collective_timeout_s: float = 1800.0

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """Values no run could use (freetx.fields: checked by `freetx validate` and before
        every run), by key: why, and the fix."""
        timeout = values.get("collective_timeout_s", 1800.0)
        if not 0 < timeout < math.inf:
            return {
                "collective_timeout_s": "it is how long a collective may wait for every rank "
                "before the run stops; set a positive number of seconds (default 1800)."
            }
        return {}


def dtype_named(name: str) -> torch.dtype:
    """The dtype a config or a command line names (bfloat16, or bf16)."""
    return DTYPES[DTYPE_ABBREVIATIONS.get(name, name)]


def check_distributed(cfg: DistributedConfig, processes: Processes = Processes()) -> MeshShape:
    """Every refusal of a `distributed:` section, made with what `processes` knows: by
    `freetx validate`, by `freetx run` / `launch` before they launch anything, by
    `freetx estimate`, and by the run itself (`build_groups`). One function, so that a
    config one of them accepts is not refused by another."""
    strategy = canonical_strategy(cfg.strategy)
    if cfg.cpu_offload:
        if strategy not in SHARDED:
            raise ConfigError(
                f"distributed.cpu_offload works with fsdp, zero2 and hsdp, not {cfg.strategy}.",
                fix="Use distributed.strategy=fsdp, or set distributed.cpu_offload=false.",
            )
        if processes.device_type == "cpu":
            raise ConfigError(
                "distributed.cpu_offload needs an accelerator: FSDP2's CPUOffloadPolicy moves "
                "parameters between GPU and CPU, and this run is on the CPU already.",
                fix="Set distributed.cpu_offload=false (or run on CUDA).",
            )
    if cfg.activation_offloading and cfg.pp > 1:
        raise ConfigError(
            "distributed.activation_offloading works on a model's forward, and with "
            f"distributed.pp={cfg.pp} the pipeline schedule runs the stages' forwards itself.",
            fix="Set distributed.activation_offloading=false (pipeline stages hold fewer "
            "blocks' activations each), or distributed.pp=1.",
        )
    check_float8(cfg.float8, cfg.tp, processes.device_type)
    check_pipeline_schedule(cfg)
    check_async_tp(cfg, processes)
    return MeshShape.of(cfg, processes)  # the axes' refusals, and hsdp's replicas


STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")  # the canonical names


def strategy_shapes(
    cfg: DistributedConfig, processes: Processes, replicas: int | None = None
) -> tuple[list[MeshShape], dict[str, str]]:
    """The shape of every strategy for `cfg`'s other axes on `processes` (hsdp with
    `replicas`), and why a run would refuse the others: what `freetx estimate` compares."""
    shapes, refused = [], {}
    for strategy in STRATEGIES:
        try:
            options = dict(strategy=strategy, replicate_degree=replicas)
            shapes.append(check_distributed(dataclasses.replace(cfg, **options), processes))
        except ConfigError as e:
            refused[strategy] = e.problems[0]
    return shapes, refused


def check_pipeline_schedule(cfg: DistributedConfig) -> None:
    """pp_schedule and pp_stages_per_rank agree, and pp_blocks_per_stage gives every stage."""
    per_rank = cfg.pp_stages_per_rank
    if cfg.pp_schedule == "interleaved_1f1b" and per_rank < 2 and cfg.pp > 1:
        raise ConfigError(
            "distributed.pp_schedule=interleaved_1f1b runs several stages per rank (its "
            "bubble shrinks with them), and distributed.pp_stages_per_rank is 1.",
            fix="Set distributed.pp_stages_per_rank=2 (or more), or pp_schedule=1f1b.",
        )
    if cfg.pp_schedule != "interleaved_1f1b" and per_rank > 1:
        raise ConfigError(
            f"distributed.pp_stages_per_rank={per_rank}: pp_schedule={cfg.pp_schedule} runs "
            "one stage per rank; interleaved_1f1b runs several.",
            fix="Set distributed.pp_schedule=interleaved_1f1b, or pp_stages_per_rank=1.",
        )
    given = cfg.pp_blocks_per_stage
    if given is not None and len(given) != num_stages(cfg):
        raise ConfigError(
            f"distributed.pp_blocks_per_stage lists {len(given)} stage(s), and pp={cfg.pp} x "
            f"pp_stages_per_rank={per_rank} makes {num_stages(cfg)}.",
            fix=f"Give {num_stages(cfg)} block counts (first stage first), or leave it "
            "out for an even split.",
        )


def check_async_tp(cfg: DistributedConfig, processes: Processes) -> None:
    """distributed.async_tp: tp's collectives overlapped inside compiled blocks on CUDA."""
    if not cfg.async_tp:
        return
    why = None
    if cfg.tp == 1:
        why = (
            "overlaps tensor parallelism's collectives with its matmuls, and "
            "distributed.tp=1 has none",
            "Set distributed.tp to 2 or more",
        )
    elif not cfg.compile:
        why = (
            "is a pass of Inductor over the compiled blocks, and distributed.compile is false",
            "Set distributed.compile=true",
        )
    elif processes.device_type == "cpu":
        why = (
            "splits collectives through CUDA's symmetric memory, and this run is on the CPU",
            "Run on CUDA",
        )
    if why is not None:
        raise ConfigError(
            f"distributed.async_tp {why[0]}.", fix=f"{why[1]}, or set async_tp=false."
        )

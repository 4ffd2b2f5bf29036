"""`freetx estimate`: memory per rank and step time of a config, for each strategy, before
renting GPUs. Analytic, from the model's exact parameter counts (it is built on the
meta device, adapters and all) and its shape:

model states (exact): parameters (fp32 masters; frozen LoRA bases in the compute
dtype; NF4 bases at 0.516 bytes), gradients of what trains (fp32), the optimizer's states
by its class (AdamW's two fp32 moments: 8 bytes per trained element; torchao's 8-bit
AdamW about 2: `freetx.planning.rungs`), each divided by the ranks that shard it:

    | strategy | parameters | gradients | optimizer |
    | ddp      | 1          | 1         | 1         |
    | zero1    | 1          | 1         | 1/N       |
    | zero2    | 1/N        | 1/N       | 1/N       |  + every block gathered (fwd to bwd)
    | fsdp     | 1/N        | 1/N       | 1/N       |  + two blocks gathered at a time
    | hsdp     | 1/S        | 1/S       | 1/S       |  S = N / replicas

activations per micro-batch: the model's own count (`EstimatesActivations`: the
decoder's per token and block, and its logits, in freetx/models/decoder/estimate.py; AD's
transformer and the generic transformers path counted as a decoder; the crosscoder's per
row), told the micro-batch and what of the run changes it (`TrainingShape`); a model
without blocks is gathered whole by FSDP. A crosscoder's frozen source models
(`freetx.planning.sources`) are counted on every rank. Step time:
training FLOPs per token (from the active parameters of an MoE model) x tokens per rank
/ (peak x MFU),
and the FSDP traffic (gathers in forward and backward, a reduce-scatter) over the
interconnect, assumed overlapped: the step takes the longer of the two; activation
checkpointing adds the recomputed forward (a third of the FLOPs; selective every n-th
block: 1/n of that).

Expert parallelism (`ep`): a rank's model states are the same share as without it (its
E / ep experts of each block sharded over dp / ep x cp ranks: 1 / (dp x cp) of them, as
FSDP2 shards the rest), reported apart (`expert_states`); what changes is what a rank
gathers (a block's E / ep experts, not E: the gathered unit and FSDP's traffic shrink)
and the all-to-alls of the tokens: each MoE block sends its k copies of every token of
the micro-batch to their experts' ranks and back, (ep - 1) / ep of them leaving the
rank, in forward and again in backward (and in a recomputed forward), on the critical
path (`all_to_all`: bytes per rank and micro-batch).

The memory ladder's rungs (`Rungs`), per rank:

- optimizer.offload=cpu: the optimizer's states, an fp32 copy of what this rank trains and
  its gradient buffer (4 + 4 bytes per element) in `host` memory, none on the device; the
  device's gradients are copied and freed as backward produces them under the sharded
  strategies and on one process (one block's counted; on one process with gradient
  accumulation, all of them), and stay under the all-reducing ones;
- optimizer.in_backward: the gradients of the largest trained parameter only;
- distributed.activation_offloading: the kept activations, taken as the same share per
  block, in `host` memory except two blocks' (the one computed and the one prefetched);
  with activation checkpointing, one block's recomputed activations stay on the device
  too; the copies are taken as overlapped (no step time);
- distributed.float8: the blocks' Linears' FLOPs (6 per weight and token) at the device's
  float8 peak, the rest at its bf16 one; tensorwise under a sharded strategy gathers those
  weights at 1 byte per element.

What it leaves out: the allocator's fragmentation and caching (5-10% on CUDA),
communication buffers beyond the gathered blocks, compile's saved memory, pinned host
memory's rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from torch import nn

from freetx.distributed import FrozenBase, MeshShape, StateSharding, canonical_name, frozen_base
from freetx.distributed.expert_parallel import check_expert_parallel, expert_modules
from freetx.distributed.float8 import float8_filter
from freetx.distributed.parallelize import find_blocks
from freetx.distributed.tensor_parallel import check_slices
from freetx.errors import ConfigError
from freetx.models.decoder.config import TransformerConfig
from freetx.models.engine import EngineConfig
from freetx.models.memory import TrainingShape
from freetx.models.moe import MoEFeedForward
from freetx.models.protocol import (
    CountsFlops,
    EstimatesActivations,
    StoredInOwnForm,
    require_hook,
    training_flops_per_token,
)
from freetx.planning.rungs import Rungs


class Device(NamedTuple):
    """A device's published figures."""

    peak: float  # dense bf16 tensor FLOP/s
    bandwidth: float  # intra-node bytes/s per GPU
    memory_gib: float
    float8_peak: float | None = None  # dense float8 tensor FLOP/s; None: no float8 matmuls


DEVICES = {
    "h100": Device(989e12, 450e9, 80, 1979e12),
    "h200": Device(989e12, 450e9, 140, 1979e12),  # H100 SXM's compute and NVLink; 143,771 MiB
    "a100": Device(312e12, 240e9, 80),
    # Ada's whitepaper, fp32 accumulate, dense; PCIe 4.0 x16 between GPUs
    "rtx4090": Device(165.2e12, 32e9, 24, 330.3e12),
    "cpu": Device(0.155e12, 10e9, 24),  # this machine's fp32 matmul peak on 2 threads
}
GIB = 2**30


@dataclass
class Estimate:
    strategy: str
    parameters: float
    gradients: float
    optimizer: float
    gathered: float
    activations: float
    loss: float
    step_s: float
    compute_s: float
    comm_s: float
    sources: float = 0.0  # a crosscoder's frozen source models while they harvest
    reference: float = 0.0  # a preference loss's frozen copy of the model
    # online RL's generation phase, instead of training's gathered + activations + loss:
    # every parameter gathered in the compute dtype, the KV cache, a step's logits
    generation: float = 0.0
    # host memory: an offloaded optimizer's states, fp32 copy and gradients; offloaded
    # activations (not in `peak`, which is the device's)
    host: float = 0.0
    # expert parallelism: this rank's share of the experts' parameters, gradients and
    # optimizer states (within `states`), and the tokens' all-to-all bytes per micro-batch
    expert_states: float = 0.0
    all_to_all: float = 0.0

    @property
    def states(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def peak(self) -> float:
        training = self.gathered + self.activations + self.loss
        return self.states + max(training, self.generation) + self.sources + self.reference


@dataclass(frozen=True)
class GenerationPhase:
    """Online RL's generation on one rank: `rows` sequences of up to `length` tokens, by
    the generation engine (`EngineConfig`: its slots and pool)."""

    rows: int
    length: int
    engine: EngineConfig | None = None  # None: its defaults

    def pool_blocks(self, model: nn.Module) -> tuple[int, int, int]:
        """(blocks in the pool, tokens per block, slots): `kv_blocks`, or enough for every
        slot's longest row; for a model the engine does not serve, the static batch's
        dense cache (every row at the longest: one block of `length` per row)."""
        engine = self.engine or EngineConfig()
        if not engine.serves(model):
            return self.rows, self.length, self.rows
        slots, size = min(engine.slots or self.rows, self.rows), engine.block_size
        return engine.kv_blocks or slots * math.ceil(self.length / size), size, slots

    def cache_bytes(self, model: nn.Module, compute: int, tp: int) -> float:
        """The KV cache's pool (every layer's entries per token: this tp rank's keys and
        values, or multi-head latent attention's compressed latent and rope key) and one
        step's logits (fp32) per slot, by the decoder's shape (`model.config`)."""
        c = model.config
        latent = isinstance(c, TransformerConfig) and c.kv_lora_rank is not None
        if latent and (self.engine or EngineConfig()).serves(model):  # the engine's latent
            per_token = c.num_layers * (c.kv_lora_rank + c.head_dim) * compute
        elif latent:  # the static batch's keys (nope + rope dims) and values per head
            per_head = c.qk_nope_head_dim + c.head_dim + c.v_head_dim
            per_token = c.num_layers * c.num_heads * per_head * compute
        else:
            per_token = c.num_layers * 2 * (c.num_kv_heads // tp) * c.head_dim * compute
        blocks, size, slots = self.pool_blocks(model)
        return blocks * size * per_token + slots * 2 * c.vocab_size * 4


def parameter_bytes(
    model: nn.Module,
    compute_bytes: int,
    frozen: FrozenBase,
    sliced: frozenset = frozenset(),
    tp: int = 1,
    within: frozenset | None = None,
) -> tuple[float, float]:
    """(bytes of all parameters as stored, trainable elements) on one tensor-parallel rank:
    NF4 bases at their quantized size, the frozen parameters the decision keeps in the
    compute dtype in it, the rest as fp32 masters; the parameters of the `sliced` modules
    divided by `tp`; `within`: only the parameters of these modules (by name)."""
    stored = trainable = 0.0
    for name, p, share in _shares(model, sliced, tp):
        if within is not None and name.rpartition(".")[0] not in within:
            continue
        owner, local_name = _owner(model, name)
        if isinstance(owner, StoredInOwnForm) and owner.stores_parameter(local_name):
            stored += p.numel() * owner.stored_element_bytes(local_name) * share
        elif canonical_name(name) in frozen.in_compute_dtype:
            stored += p.numel() * compute_bytes * share
        else:
            stored += p.numel() * 4 * share
        trainable += p.numel() * share if p.requires_grad else 0
    return stored, trainable


def _shares(model: nn.Module, sliced: frozenset, tp: int):
    """(name, parameter, the share of it one tensor-parallel rank holds) of each parameter."""
    for name, p in model.named_parameters():
        yield name, p, 1 / tp if name.rpartition(".")[0] in sliced else 1.0


def trained_sizes(model: nn.Module, sliced: frozenset = frozenset(), tp: int = 1) -> list[float]:
    """The elements of each trainable parameter on one tensor-parallel rank."""
    return [p.numel() * share for _, p, share in _shares(model, sliced, tp) if p.requires_grad]


def float8_elements(model: nn.Module, module: nn.Module) -> int:
    """The weight elements of the Linears in `module` (a part of `model`) that
    distributed.float8 converts (`freetx.distributed.float8.float8_filter`'s rule)."""
    converts = float8_filter(model)
    names = {id(m): name for name, m in model.named_modules()}
    return sum(m.weight.numel() for m in module.modules() if converts(m, names[id(m)]))


def offloaded_activations(model: nn.Module, run: TrainingShape, kept: float) -> float:
    """What activation offloading moves to host memory of the `kept` activations of `run`:
    all but two blocks' shares (the block computed and the one prefetched), the kept
    bytes taken as the same per block; with checkpointing, less one block's recomputed
    activations (its whole count without checkpointing), which stay on the device."""
    if run.blocks <= 2:
        return 0.0
    recomputed = 0.0
    if run.checkpointing != "none":
        recomputed = model.activation_bytes(replace(run, checkpointing="none")).kept / run.blocks
    return (kept - recomputed) * (1 - 2 / run.blocks)


def sliced_modules(model: nn.Module, tp: int) -> frozenset:
    """The modules tensor parallelism slices (their parameters 1/tp per rank): the model's
    plan (`SlicesLayers`), which refuses a tp it cannot take; none at tp=1."""
    if tp == 1:
        return frozenset()
    check_slices(model)
    plan = model.tensor_parallel_plan(tp)
    return frozenset(name for name, role in plan.items() if role != "heads_norm")


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, local_name = name.rpartition(".")
    return (model.get_submodule(module_name) if module_name else model), local_name


@dataclass(frozen=True)
class ExpertShape:
    """What expert parallelism changes in a model's estimate: its experts' parameters
    (`stored` bytes, `trainable` elements, `sizes` of the trained tensors), those of the
    gathered unit (`in_unit` elements), and the all-to-all bytes of one micro-batch per
    rank (`exchanged`)."""

    ep: int = 1
    stored: float = 0.0
    trainable: float = 0.0
    sizes: tuple = ()
    in_unit: float = 0.0
    exchanged: float = 0.0

    @classmethod
    def of(
        cls,
        model: nn.Module,
        unit: nn.Module,
        ep: int,
        compute: int,
        frozen: FrozenBase,
        tokens: int,
        passes: float,
        stage: bool = False,
    ) -> ExpertShape:
        """`model`'s experts spread over `ep` ranks (`check_expert_parallel`'s refusals;
        a pipeline `stage` may hold none): `tokens` per rank and micro-batch, each sent out
        and back `passes` times (2: forward and backward; more with recomputed forwards)."""
        if ep == 1:
            return cls()
        blocks = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
        for size in {b.experts.w1.shape[0] for b in blocks} or ({0} if not stage else set()):
            check_expert_parallel(size, ep)
        names = frozenset(expert_modules(model))
        stored, trainable = parameter_bytes(model, compute, frozen, within=names)
        sizes = tuple(
            p.numel()
            for n, p in model.named_parameters()
            if p.requires_grad and n.rpartition(".")[0] in names
        )
        in_unit = sum(p.numel() for m in expert_modules(unit).values() for p in m.parameters())
        # per block: k copies of each token, hidden wide, out and back, (ep - 1) / ep leaving
        rows = sum(b.top_k * b.experts.w1.shape[2] for b in blocks)
        exchanged = 2 * passes * tokens * rows * compute * (ep - 1) / ep
        return cls(ep, stored, trainable, sizes, in_unit, exchanged)


def estimate(
    model: nn.Module,
    shapes: list[MeshShape],
    tokens_per_rank: int,
    seq_len: int,
    compute_dtype: str,
    activation_checkpointing: str,
    ac_every_n_blocks: int,
    device: str,
    mfu: float,
    rungs: Rungs | None = None,
    frozen: FrozenBase | None = None,
    sources: float = 0.0,
    loss_chunks: int | None = 1,
    stage: PipelineStageShape | None = None,
    sequence_parallel: bool = False,
    reference: str = "none",
    generation: GenerationPhase | None = None,
) -> list[Estimate]:
    """The estimate of a (meta) model under each of `shapes` (one per strategy, with the
    same axes: `strategy_shapes`); `frozen`:
    the frozen-base decision (`frozen_base`, made from the model when not given);
    `rungs`: the memory ladder's (`Rungs`: the optimizer's states, its offload or steps
    in backward, activation offloading, float8; the module docstring); None: AdamW's
    states, no rung; `sources`: bytes every rank holds besides (a crosscoder's source models);
    `loss_chunks`: the loss's logits a chunk of tokens at a time (`num_chunks`; None: the
    model's default); the
    shapes' `tp`: tensor-parallel ranks (the sliced layers 1/tp per rank, whose
    micro-batch of `tokens_per_rank` every rank of a tp group computes 1/tp of, with two
    sums of its activations over tp per block and pass on the critical path); `cp`:
    context-parallel ranks (each holds 1/cp of the micro-batch's tokens, and keeps the
    whole sequence's keys and values of each block for backward; an all-gather of them
    per block in forward, again in a recomputed forward, and a reduce-scatter of their
    gradients in backward, on the critical path; FSDP2 shards over dp_shard x cp);
    `stage`: under pipeline parallelism, `model` is one stage's (pruned: `keep_blocks`),
    whose activations are kept for `stage.in_flight` micro-batches at once, whose share
    of the work is 1/pp, stretched by the schedule's bubble; FSDP2 shards within it;
    `sequence_parallel`: with tp, the residual stream and its norms 1/tp per rank;
    `reference`: a preference loss's (`PlannedRun.reference`): `frozen_copy` holds every
    parameter again in the compute dtype, sharded as the strategy shards parameters, and
    runs one more forward per micro-batch (a third of a training step's FLOPs), as
    `adapters_off` does without the copy; `precomputed` costs nothing while training;
    `generation`: online RL's generation phase (`GenerationPhase`), which holds every
    parameter gathered (a sharded strategy's: in the compute dtype) and the KV cache, in
    place of a training step's gathered blocks, activations and loss."""
    if not shapes:
        return []
    axes = shapes[0]  # pp, cp and tp: the same in every shape
    tp, cp = axes.tp, axes.cp
    compute = 2 if compute_dtype in ("bfloat16", "float16") else 4
    frozen = frozen or frozen_base(model)
    sliced = sliced_modules(model, tp)
    rungs = rungs or Rungs()
    stored, trainable = parameter_bytes(model, compute, frozen, sliced, tp)
    total_trainable = parameter_bytes(model, compute, frozen)[1]
    sizes = trained_sizes(model, sliced, tp)
    blocks = find_blocks(model)
    # what FSDP gathers at a time: two blocks (one prefetched), or a model without blocks whole
    unit, copies = (blocks[0], 2) if blocks else (model, 1)
    unit_name = next((n for n, m in model.named_modules() if m is unit), "")
    unit_shares = [
        (p, 1 / tp if f"{unit_name}.{n}".lstrip(".").rpartition(".")[0] in sliced else 1)
        for n, p in unit.named_parameters()
    ]
    block_params = sum(p.numel() * share for p, share in unit_shares)
    block_trained = sum(p.numel() * share for p, share in unit_shares if p.requires_grad)
    recomputed = {"none": 0, "full": 1}.get(activation_checkpointing, 1 / ac_every_n_blocks)
    experts = ExpertShape.of(
        model,
        unit,
        axes.ep,
        compute,
        frozen,
        tokens_per_rank // cp,
        2 + recomputed,
        stage=stage is not None,
    )
    block_params -= experts.in_unit * (1 - 1 / experts.ep)  # its E / ep experts gathered
    device_figures = DEVICES[device]
    float8 = rungs.float8 != "none"
    if float8 and device_figures.float8_peak is None:
        raise ConfigError(
            f"distributed.float8={rungs.float8}: the {device} has no float8 matmuls (they "
            "need CUDA capability 8.9+).",
            fix="Set distributed.float8=none, or estimate for --device h100, h200 or rtx4090.",
        )
    # float8's Linears (tp is 1 with float8): all blocks' and the gathered unit's weights
    fast = sum(float8_elements(model, b) for b in blocks) if float8 else 0
    # tensorwise gathers them in float8: 1 byte per element instead of the compute dtype's
    unit_saved = float8_elements(model, unit) * (compute - 1) if rungs.float8 == "tensorwise" else 0
    all_saved = fast * (compute - 1) if rungs.float8 == "tensorwise" else 0
    require_hook(
        model,
        EstimatesActivations,
        "freetx estimate cannot count its activations",
        "Give its class activation_bytes(run) (freetx.models.protocol.EstimatesActivations).",
    )
    run = TrainingShape(
        tokens_per_rank,
        seq_len,
        compute,
        len(blocks),
        activation_checkpointing,
        ac_every_n_blocks,
        loss_chunks,
        tp,
        cp,
        sequence_parallel,
        "cpu" if device == "cpu" else "cuda",
    )
    counted = model.activation_bytes(run)
    activations, loss = counted.kept, counted.loss
    offloaded = 0.0
    if rungs.activation_offloading:
        offloaded = offloaded_activations(model, run, activations)
        activations -= offloaded
    stage = stage or PipelineStageShape()
    activations *= stage.in_flight
    offloaded *= stage.in_flight
    loss = loss if stage.holds_loss else 0.0
    peak, bandwidth = device_figures.peak, device_figures.bandwidth
    flops = (
        training_flops_per_token(model, seq_len)
        if isinstance(model, CountsFlops)
        else 6 * total_trainable
    )
    fast_flops = min(6 * fast, flops)  # float8's Linears, forward and backward
    seconds = (flops - fast_flops) / peak + fast_flops / (device_figures.float8_peak or peak)
    if reference in ("frozen_copy", "adapters_off"):  # the reference's forward: 2 of 6
        seconds *= 4 / 3
    if activation_checkpointing != "none":  # the checkpointed blocks' forward again
        every = ac_every_n_blocks if activation_checkpointing == "selective" else 1
        seconds *= 1 + 1 / (3 * every)
    compute_s = seconds * tokens_per_rank / (mfu * axes.per_data_rank) * (1 + stage.bubble)
    copy = 0.0
    if reference == "frozen_copy":  # every parameter again, in the compute dtype
        elements = sum(
            p.numel() / (tp if name.rpartition(".")[0] in sliced else 1)
            for name, p in model.named_parameters()
        )
        copy = elements * compute
    # tp's sums and cp's gathers, ep's all-to-alls: not overlapped
    tp_s = (counted.exchanged + experts.exchanged) / bandwidth
    elsewhere = experts.stored * (1 - 1 / experts.ep)  # the experts other ep ranks hold
    cache = generation.cache_bytes(model, compute, tp) if generation is not None else 0.0
    out = []
    for shape in shapes:
        layout, world_size = StateSharding.of(shape), shape.world_size
        shards = layout.parameter_shards
        if layout.blocks_stay_gathered:  # every block kept unsharded, forward to backward
            gathered = (stored - elsewhere) / 4 * compute - all_saved
        elif layout.gathers_per_block:  # + a unit's grads
            gathered = copies * (block_params * compute - unit_saved) + block_params * 4
        elif layout.all_reduce and world_size > 1:
            # DDP's gradient buckets: allocated once and kept, even while the gradients
            # (views of them) are None between steps
            gathered = trainable * 4
        else:
            gathered = 0.0
        # two gathers (forward, backward) and a reduce-scatter
        traffic = 3 * (stored - experts.stored) / 4 * compute - 2 * all_saved
        traffic = 0.0 if shards == 1 else traffic * (shards - 1) / shards
        # this rank's E / ep experts, gathered over the dp / ep x cp ranks that shard them
        own, expert_shards = experts.stored / experts.ep, shape.expert_fsdp
        traffic += 3 * own / 4 * compute * (expert_shards - 1) / expert_shards
        if layout.all_reduce and world_size > 1:
            traffic = 2 * trainable * 4 * (shape.dp - 1) / shape.dp  # an all-reduce
        comm_s = traffic / bandwidth
        gradients, optimizer, host = model_state_rungs(
            rungs, layout, world_size, sizes, block_trained
        )
        row = Estimate(
            strategy=layout.strategy,
            parameters=stored / shards,
            gradients=gradients,
            optimizer=optimizer,
            gathered=gathered if world_size > 1 else 0.0,
            activations=activations,
            loss=loss,
            step_s=max(compute_s, comm_s) + tp_s,
            compute_s=compute_s,
            comm_s=comm_s + tp_s,
            sources=sources,
            reference=copy / shards,
            generation=cache + (stored / 4 * compute if shards > 1 else 0.0) if generation else 0.0,
            host=host + offloaded,
            expert_states=expert_state_bytes(experts, rungs, layout),
            all_to_all=experts.exchanged,
        )
        out.append(row)
    return out


def expert_state_bytes(experts: ExpertShape, rungs: Rungs, layout: StateSharding) -> float:
    """One rank's share of the experts' parameters, gradients and optimizer states (0
    without expert parallelism): 1 / (ep x dp / ep x cp) of each, as the rest's."""
    if experts.ep == 1:
        return 0.0
    states = sum(rungs.states.bytes(n / layout.optimizer_shards) for n in experts.sizes)
    gradients = experts.trainable * 4 / layout.gradient_shards
    return experts.stored / layout.parameter_shards + gradients + states


def model_state_rungs(
    rungs: Rungs, layout: StateSharding, world_size: int, sizes: list[float], block: float
) -> tuple[float, float, float]:
    """(device gradients, device optimizer states, host bytes) on one rank of `layout`,
    for trained parameters of `sizes` elements (one tensor-parallel rank's), `block` of
    them in the unit FSDP gathers (the module docstring)."""
    trainable = sum(sizes)
    states = sum(rungs.states.bytes(n / layout.optimizer_shards) for n in sizes)
    gradients = trainable * 4 / layout.gradient_shards
    if rungs.in_backward:  # each freed once its parameter stepped
        return max(sizes, default=0.0) * 4 / layout.gradient_shards, states, 0.0
    if not rungs.optimizer_offload:
        return gradients, states, 0.0
    copied = rungs.accumulation == 1 if world_size == 1 else not layout.all_reduce
    if copied:  # to the host as backward produces them: one block's at a time
        gradients = min(block, trainable) * 4 / layout.gradient_shards
    return gradients, 0.0, states + 8 * trainable / layout.optimizer_shards


@dataclass(frozen=True)
class PipelineStageShape:
    """What pipeline parallelism changes for one stage's estimate (`estimate(stage=)`)."""

    in_flight: int = 1  # micro-batches whose activations a stage keeps at once (1F1B: pp)
    bubble: float = 0.0  # the schedule's idle share: (pp - 1) / (stages per rank x micro-batches)
    holds_loss: bool = True  # the last stage: the head's logits


def pipeline_stage_shapes(cfg, micro_batches: int) -> list[PipelineStageShape]:
    """The first and the last stage's shapes under `cfg` (a `distributed:` section): the
    first keeps the most micro-batches in flight, the last computes the loss."""
    pp, per_rank = cfg.pp, cfg.pp_stages_per_rank
    in_flight = micro_batches if cfg.pp_schedule == "gpipe" else min(pp, micro_batches)
    bubble = (pp - 1) / (per_rank * micro_batches)
    return [PipelineStageShape(in_flight, bubble, False), PipelineStageShape(1, bubble, True)]

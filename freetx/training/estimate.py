"""`freetx estimate`: memory per rank and step time of a config, for each strategy, before
renting GPUs. Analytic, from the model's exact parameter counts (it is built on the
meta device, adapters and all) and its shape:

model states (exact): parameters (fp32 masters; frozen LoRA bases in the compute
dtype; NF4 bases at 0.516 bytes), gradients of what trains (fp32), AdamW's two
moments (fp32; 8-bit optimizers: 2 bytes), each divided by the ranks that shard it:

    | strategy | parameters | gradients | optimizer |
    | ddp      | 1          | 1         | 1         |
    | zero1    | 1          | 1         | 1/N       |
    | zero2    | 1/N        | 1/N       | 1/N       |  + every block gathered (fwd to bwd)
    | fsdp     | 1/N        | 1/N       | 1/N       |  + two blocks gathered at a time
    | hsdp     | 1/S        | 1/S       | 1/S       |  S = N / replicas

activations per micro-batch, counted per token and block for the decoder (compute
dtype): the norm inputs and outputs, q, k, v and the attention output kept by SDPA,
the input of wo, and the four MLP tensors (gate, up, silu(gate), their product):
7h + 2 h_kv + 4 f elements (an MoE block: k (4 f_expert + 2h) + 2E instead of 4 f: each
token's k experts, its copies and weighted outputs, the router's logits and probs; and,
for soft-capped attention where the explicit kernel computes it, the rows of T scores per
head it keeps: `attention_score_bytes`); full checkpointing keeps a block's input (h) instead,
selective every n-th; and the loss: bf16 logits, their fp32 copy and log-softmax
(10 bytes per token per vocabulary entry), which dominate small models with large
vocabularies. AD's transformer is counted as a decoder (n_transit tokens per window). A
model with its own count (`EstimatesActivations`: the crosscoder's, per row) gives its
activations, loss included; a model without blocks is gathered whole by FSDP. A
crosscoder's frozen source models (`activation_sources`: built on the meta device from
their recorded config, never their weights) are counted on every rank: their weights in
the source dtype and one harvesting forward (logits, hooked outputs). Step time:
training FLOPs per token (from the active parameters of an MoE model) x tokens per rank
/ (peak x MFU),
and the FSDP traffic (gathers in forward and backward, a reduce-scatter) over the
interconnect, assumed overlapped: the step takes the longer of the two.

What it leaves out: the allocator's fragmentation and caching (5-10% on CUDA),
communication buffers beyond the gathered blocks, compile's saved memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from freetx.distributed import FrozenBase, MeshShape, ShardLayout, canonical_name, frozen_base
from freetx.distributed.parallelize import find_blocks
from freetx.distributed.tensor_parallel import check_slices
from freetx.models.attention import AttentionSpec, choose_kernel, sliding_layers
from freetx.models.peft.nf4 import BYTES_PER_WEIGHT, NF4LoRALinear
from freetx.models.protocol import CountsFlops, EstimatesActivations, check_model
from freetx.training.checks import dataset_seq_len

# device -> (peak dense bf16 FLOP/s, intra-node GB/s per GPU, HBM GiB)
DEVICES = {
    "h100": (989e12, 450e9, 80),
    "a100": (312e12, 240e9, 80),
    "cpu": (0.155e12, 10e9, 24),  # this machine's fp32 matmul peak on 2 threads
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

    @property
    def states(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def peak(self) -> float:
        return self.states + self.gathered + self.activations + self.loss + self.sources


def parameter_bytes(
    model: nn.Module,
    compute_bytes: int,
    frozen: FrozenBase,
    sliced: frozenset = frozenset(),
    tp: int = 1,
) -> tuple[float, float]:
    """(bytes of all parameters as stored, trainable elements) on one tensor-parallel rank:
    NF4 bases at their quantized size, the frozen parameters the decision keeps in the
    compute dtype in it, the rest as fp32 masters; the parameters of the `sliced` modules
    divided by `tp`."""
    stored = trainable = 0.0
    for name, p in model.named_parameters():
        owner, local_name = _owner(model, name)
        share = 1 / tp if name.rpartition(".")[0] in sliced else 1.0
        if isinstance(owner, NF4LoRALinear) and owner.stores_parameter(local_name):
            stored += p.numel() * BYTES_PER_WEIGHT * share
        elif canonical_name(name) in frozen.in_compute_dtype:
            stored += p.numel() * compute_bytes * share
        else:
            stored += p.numel() * 4 * share
        trainable += p.numel() * share if p.requires_grad else 0
    return stored, trainable


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
    optimizer_bytes: float = 8.0,
    frozen: FrozenBase | None = None,
    sources: float = 0.0,
    loss_chunks: int = 1,
    stage: PipelineStageShape | None = None,
    sequence_parallel: bool = False,
) -> list[Estimate]:
    """The estimate of a (meta) model under each of `shapes` (one per strategy, with the
    same axes: `strategy_shapes`); `frozen`:
    the frozen-base decision (`frozen_base`, made from the model when not given);
    `sources`: bytes every rank holds besides (a crosscoder's source models);
    `loss_chunks`: the loss's logits a chunk of tokens at a time (`num_chunks`); the
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
    `sequence_parallel`: with tp, the residual stream and its norms 1/tp per rank."""
    if not shapes:
        return []
    axes = shapes[0]  # pp, cp and tp: the same in every shape
    tp, cp = axes.tp, axes.cp
    compute = 2 if compute_dtype in ("bfloat16", "float16") else 4
    frozen = frozen or frozen_base(model)
    sliced = sliced_modules(model, tp)
    stored, trainable = parameter_bytes(model, compute, frozen, sliced, tp)
    total_trainable = parameter_bytes(model, compute, frozen)[1]
    blocks = find_blocks(model)
    # what FSDP gathers at a time: two blocks (one prefetched), or a model without blocks whole
    unit, copies = (blocks[0], 2) if blocks else (model, 1)
    unit_name = next((n for n, m in model.named_modules() if m is unit), "")
    block_params = sum(
        p.numel() / (tp if f"{unit_name}.{n}".lstrip(".").rpartition(".")[0] in sliced else 1)
        for n, p in unit.named_parameters()
    )
    if isinstance(model, EstimatesActivations):
        activations, loss = model.activation_bytes(tokens_per_rank // cp, compute), 0.0
    else:
        activations, loss = decoder_activations(
            model.config, len(blocks), tokens_per_rank, compute, activation_checkpointing,
            ac_every_n_blocks, attention_score_bytes(model.config, seq_len, device, compute),
            loss_chunks, tp, cp, sequence_parallel,
        )  # fmt: skip
    stage = stage or PipelineStageShape()
    activations *= stage.in_flight
    loss = loss if stage.holds_loss else 0.0
    peak, bandwidth, _ = DEVICES[device]
    flops = (
        model.flops_per_token(seq_len) if isinstance(model, CountsFlops) else 6 * total_trainable
    )
    compute_s = flops * tokens_per_rank / (peak * mfu * axes.per_data_rank) * (1 + stage.bubble)
    # tensor parallelism's sums: two all-reduces of the block's output per block and pass
    hidden = getattr(getattr(model, "config", None), "hidden_dim", 0)
    tp_bytes = 4 * len(blocks) * tokens_per_rank / cp * hidden * compute * 2 * (tp - 1) / tp
    # context parallelism's gathers of the whole sequence's keys and values (this rank's
    # kv heads: 1/tp), per block: forward, a recomputed forward, backward's reduce-scatter
    passes = 3 if activation_checkpointing != "none" else 2
    kv = kv_width(getattr(model, "config", None))
    cp_bytes = passes * len(blocks) * tokens_per_rank * 2 * kv / tp * compute * (cp - 1) / cp
    tp_s = (tp_bytes + cp_bytes) / bandwidth
    out = []
    for shape in shapes:
        layout, world_size = ShardLayout.of(shape), shape.world_size
        shards = layout.parameter_shards
        if layout.blocks_stay_gathered:
            gathered = stored / 4 * compute  # every block kept unsharded, forward to backward
        elif layout.gathers_per_block:
            gathered = copies * block_params * compute + block_params * 4  # + a unit's grads
        elif layout.all_reduce and world_size > 1:
            # DDP's gradient buckets: allocated once and kept, even while the gradients
            # (views of them) are None between steps
            gathered = trainable * 4
        else:
            gathered = 0.0
        traffic = 0.0 if shards == 1 else 3 * stored / 4 * compute * (shards - 1) / shards
        if layout.all_reduce and world_size > 1:
            traffic = 2 * trainable * 4 * (shape.dp - 1) / shape.dp  # an all-reduce
        comm_s = traffic / bandwidth
        out.append(Estimate(
            layout.strategy, stored / shards, trainable * 4 / layout.gradient_shards,
            trainable * optimizer_bytes / layout.optimizer_shards,
            gathered if world_size > 1 else 0.0, activations, loss,
            max(compute_s, comm_s) + tp_s, compute_s, comm_s + tp_s, sources,
        ))  # fmt: skip
    return out


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


def attention_score_bytes(cfg, seq_len: int, device: str, compute: int) -> float:
    """Bytes per token and block (averaged over the blocks) that the explicit attention
    kernel keeps for backward where `freetx.models.attention.choose_kernel` picks it on
    `device` (soft-capped layers on CPU; with attention dropout on CUDA too): each query's
    row of seq_len scores per head, as the tanh output and the weights (compute dtype)
    and the float32 softmax. SDPA and compiled FlexAttention keep no such rows."""
    layers = getattr(cfg, "num_layers", 0)
    softcap = getattr(cfg, "attn_logit_softcap", None)
    if not layers or softcap is None:
        return 0.0
    device_type = "cpu" if device == "cpu" else "cuda"
    dropout = getattr(cfg, "attention_dropout", 0.0)
    explicit = sum(
        choose_kernel(device_type, AttentionSpec(window=cfg.sliding_window if sliding else None,
                                                 softcap=softcap), dropout) == "explicit"
        for sliding in sliding_layers(layers, cfg.sliding_window, cfg.layer_types)
    )  # fmt: skip
    return explicit / layers * cfg.num_heads * seq_len * (2 * compute + 4)


def decoder_activations(
    cfg,
    layers: int,
    tokens: int,
    compute: int,
    checkpointing: str,
    every_n: int,
    scores: float = 0.0,
    loss_chunks: int = 1,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
) -> tuple[float, float]:
    """(activations, loss) bytes of a decoder's micro-batch of `tokens` tokens (per rank):
    each block's saved tensors per token (see the module docstring; `scores`: the
    attention's score rows, `attention_score_bytes`), less what activation checkpointing
    recomputes, and the loss's logits: all of them, or one of `loss_chunks` chunks plus
    the gradients the chunked loss holds from forward to backward (the output layer's in
    float32, the hidden states'). Under `tp`, what attention and a dense MLP keep inside
    (q, the attention output and wo's input, k and v, the MLP's four tensors, the score
    rows) is 1/tp; the norms' inputs and outputs and an MoE block's experts are whole.
    Under `cp` a rank holds `tokens` / cp of them, and its blocks keep the whole
    sequence's keys and values (cp times its own) for attention's backward. With
    `sequence_parallel` the norms' inputs and outputs, and the blocks' inputs that
    activation checkpointing keeps, are 1/tp too."""  # fmt: skip
    tokens = tokens // cp
    h, f = cfg.hidden_dim, getattr(cfg, "ffn_hidden_dim", 4 * cfg.hidden_dim)
    kv = kv_width(cfg) * cp  # keys and values gathered from the cp ranks
    layers = max(1, layers)
    mlp = 4 * f
    if getattr(cfg, "num_experts", 0):  # MoE blocks: k experts' MLP tensors per token, the
        # token copies sent to them and their weighted outputs, the router's logits and probs
        moe = cfg.experts_per_token * (4 * cfg.moe_ffn_hidden_dim + 2 * h) + 2 * cfg.num_experts
        share = sum(cfg.is_moe_layer(i) for i in range(layers)) / layers
        mlp = share * moe + (1 - share) * mlp
    dense_share = 1.0 if getattr(cfg, "num_experts", 0) else 1 / tp  # experts stay whole
    # a block's saved activations: norms whole; attention, a dense MLP and scores 1/tp
    stream = tp if sequence_parallel else 1  # the residual stream's share
    per_token = (4 * h / stream + (3 * h + 2 * kv) / tp + mlp * dense_share) * compute
    per_token += scores / tp
    block_input = h * compute / stream
    if checkpointing == "full":
        kept = layers * block_input + per_token  # inputs, and one block being recomputed
    elif checkpointing == "selective":
        checkpointed = math.ceil(layers / every_n)
        kept = (layers - checkpointed) * per_token + checkpointed * block_input + per_token
    else:
        kept = layers * per_token
    vocab = getattr(cfg, "vocab_size", 0)
    if tp > 1 and not getattr(cfg, "tie_embeddings", True):  # a head sliced by vocabulary:
        vocab = vocab / tp  # each rank's logits are its slice (a vocabulary-parallel loss)
    if loss_chunks == 1:
        return tokens * kept, tokens * vocab * (compute + 4 + 4)
    held = vocab * h * 4 + tokens * h * compute  # the head's (slice's) gradient, the hidden's
    return tokens * kept, math.ceil(tokens / loss_chunks) * vocab * (compute + 4 + 4) + held


def kv_width(cfg) -> int:
    """A decoder's key (or value) width per token: kv_heads x head_dim (0: no decoder)."""
    if not hasattr(cfg, "hidden_dim") or not hasattr(cfg, "num_heads"):
        return 0
    heads = getattr(cfg, "num_kv_heads", cfg.num_heads)
    return heads * getattr(cfg, "head_dim", cfg.hidden_dim // cfg.num_heads)


@dataclass
class ActivationSources:
    """What a crosscoder config's `activations:` read: the rows' shape, and the bytes its
    frozen source models hold on every rank (loaded for the whole run: evaluation splices
    reconstructions back into them)."""

    num_sources: int
    source_dim: int
    weights: float  # the source models' parameters in activations.source_dtype
    harvest: float  # one harvesting forward: its logits and the hooked outputs (float32)
    unread: list[str]  # sources whose shape could not be read: not counted

    @property
    def bytes(self) -> float:
        return self.weights + self.harvest


def activation_sources(acfg, device: str, source_dim: int | None = None) -> ActivationSources:
    """The rows and source models of `acfg` (an `ActivationsConfig`) on `device` (a key of
    DEVICES), without loading a weight: synthetic rows' shape from their config; each
    source model's hidden size, parameters and vocabulary from its recorded config
    (`source_model_on_meta`). `source_dim`: the hooked width, for sources that cannot be
    read or hooks on a module narrower or wider than the residual stream."""
    from freetx.checkpoint import source_model_on_meta
    from freetx.config import instantiate
    from freetx.errors import ConfigError, FreetxError

    if acfg.kind == "synthetic":
        if source_dim is not None:
            raise ConfigError(
                "--source-dim is for activations of models: synthetic rows have their own "
                "shape (activations.synthetic.source_dim).",
                fix="Leave out --source-dim, or override activations.synthetic.source_dim.",
            )
        rows = instantiate(acfg.synthetic, split="train", rows=1)
        return ActivationSources(rows.num_sources, rows.source_dim, 0.0, 0.0, [])
    dtype = acfg.source_dtype if acfg.source_dtype != "auto" else (
        "float32" if device == "cpu" else "bfloat16")  # fmt: skip
    element = 4 if dtype == "float32" else 2
    num_sources = sum(len(s.hooks) for s in acfg.sources)
    widths, weights, vocab, unread = set(), 0.0, 0, []
    for source in acfg.sources:
        try:
            model = source_model_on_meta(source.model)
        except (FreetxError, OSError, ValueError, KeyError):
            unread.append(source.model)
            continue
        c = model.config  # freetx's decoder's, or the generic transformers path's
        widths.add(c.hidden_dim)
        weights += sum(p.numel() for p in model.parameters()) * element
        vocab = max(vocab, c.vocab_size)
    if source_dim is None and unread:
        raise ConfigError(
            f"freetx estimate cannot read the shape of the source model(s) "
            f"{', '.join(unread)} (no run, checkpoint or HF config.json there yet), and a "
            "crosscoder's width is theirs.",
            fix="Give --source-dim D (the hooked modules' width, e.g. the hidden size), or "
            "make the source run first.",
        )
    if source_dim is None and len(widths) > 1:
        raise ConfigError(
            f"the source models have different hidden sizes {sorted(widths)}; a crosscoder "
            "reads one width from every source.",
            fix="Hook sites of one width, or give --source-dim D for the hooked width.",
        )
    width = source_dim or widths.pop()
    tokens = acfg.sequences_per_forward() * int(acfg.text.get("seq_len", 2048))
    harvest = tokens * (vocab * element + 2 * num_sources * width * 4)  # + stacked copy
    return ActivationSources(num_sources, width, weights, float(harvest), unread)


def meta_model(model_node, peft_cfg=None, **fields):
    """The config's model on the meta device (with its adapters when it has `peft`);
    `fields`: the model's fields the recipe gives from its data (a crosscoder's shape)."""
    from freetx.config import instantiate

    with torch.device("meta"):
        model = instantiate(model_node, **fields)
        check_model(model)
        if peft_cfg is not None:
            from freetx.models.peft import apply_peft

            apply_peft(model, peft_cfg)
    return model


# the trackers' categories (FSDPMemTracker's and MemTracker's names) -> the estimate's columns
_COLUMNS = {
    "Sharded Param": "parameters", "Parameter": "parameters",
    "Sharded Grad": "gradients", "Gradient": "gradients",
    "OptState": "optimizer", "Optstate": "optimizer",
    "Unsharded Param": "gathered", "Unsharded Grad": "gathered",
    "All Gather": "gathered", "Reduce Scatter": "gathered",
}  # fmt: skip


def measure(cfg, shape: MeshShape) -> dict[str, float]:
    """`--measure`: the bytes rank 0 holds at the peak of one training step of the config's
    micro-batch under a strategy's `shape` (no other axis), with exact tensor sizes and no real memory or compute.

    The step runs as rank 0 of `world_size` in this one process: tensors are fake (shapes,
    dtypes, no storage: torch's FakeTensorMode), collectives do nothing (the "fake"
    process group), and torch's memory trackers (FSDPMemTracker for FSDP2, MemTracker
    otherwise) count every tensor alive, by kind. A first step creates the optimizer
    state; the second is the one measured, as every later step of a run. The kernels
    are this machine's: CUDA's where there is a GPU, else the CPU's (whose RMSNorm keeps
    float32 intermediates that CUDA's fused kernel does not: ~10 h bytes per token and
    block more). DDP's gradient hooks do not run on the fake group: replicated layouts
    (ddp, zero1) measure the plain model (DDP's buckets are the gradients themselves, as
    views, kept between steps: added to `gathered`), with the optimizer state divided by
    the ranks sharing it. Returns bytes per column of `Estimate`, and `peak`.
    """
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensorMode

    from freetx.config import instantiate
    from freetx.distributed import (
        DistributedRuntime,
        ParallelGroups,
        fake_world,
        parallelize,
    )

    layout, world_size = ShardLayout.of(shape), shape.world_size
    sharded = layout.parameter_shards > 1  # else replicated: the plain model at world size 1
    distributed = dataclasses.replace(
        cfg.distributed,
        strategy=shape.strategy,
        replicate_degree=shape.dp_replicate,  # read by hsdp alone
    )
    seq_len = dataset_seq_len(cfg)
    micro = cfg.batch_size // (shape.dp * cfg.gradient_accumulation_steps)
    if not sharded:  # the plain model: one process's shape
        shape = MeshShape(shape.strategy, dp_replicate=1)
    with fake_world(world_size):
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        runtime = DistributedRuntime(0, 0, shape.world_size, device)
        meshes = shape.build(device.type) if sharded else {}
        model = meta_model(cfg.model, getattr(cfg, "peft", None))  # real meta tensors
        with FakeTensorMode(allow_non_fake_inputs=True):
            groups = ParallelGroups(runtime, shape, meshes)
            plan = parallelize(model, groups, distributed, seed=cfg.seed)
            optimizer = plan.build_optimizer(cfg.optimizer)
            loss_fn = instantiate(cfg.loss)
            input_ids = torch.randint(0, model.config.vocab_size, (micro, seq_len), device=device)
            out = tracked_step(plan, optimizer, loss_fn, input_ids, layout)
    if layout.all_reduce and world_size > 1:  # DDP's buckets, kept between steps
        buckets = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
        out["gathered"] += buckets
        out["peak"] += buckets
    return out


def tracked_step(plan, optimizer, loss_fn, input_ids, layout: ShardLayout) -> dict[str, float]:
    """One training step of `plan`'s model under torch's memory tracker (FSDPMemTracker for
    FSDP2, MemTracker otherwise), after a first step that creates the optimizer state: the
    bytes this rank held at the step's peak, by column of `Estimate`, and `peak`. Real or
    fake tensors alike (`measure`; benchmarks/estimate.py runs it on real ones)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    def step() -> None:
        with plan.autocast():
            loss, _ = loss_fn(plan.model, input_ids, input_ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer state exists from here on
    if isinstance(plan.model, FSDPModule):
        tracker = FSDPMemTracker(plan.model, optimizer)
    else:
        tracker = MemTracker()  # ZeRO-1's state lives in its local optimizer
        tracker.track_external(plan.model, getattr(optimizer, "optim", optimizer))
    with tracker:
        step()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    out = dict.fromkeys(("parameters", "gradients", "optimizer", "gathered", "activations"), 0.0)
    for kind, value in peak.items():
        name = getattr(kind, "value", kind)
        if name != "Total":
            out[_COLUMNS.get(name, "activations")] += value  # the rest: activations, temps
    out["peak"] = float(peak["Total"])
    if layout.parameter_shards == 1 and plan.runtime.world_size == 1:
        # a replicated layout run as the plain model (zero1: each rank keeps 1/N of the state)
        out["peak"] -= out["optimizer"] * (1 - 1 / layout.optimizer_shards)
        out["optimizer"] /= layout.optimizer_shards
    return out

"""The model protocol: what freetx asks of a model, and how models are configured.

A freetx model is a plain `nn.Module`; parallelism, initialization and
checkpoints are applied from outside, through these members (`Model`):

    config            a dataclass of the fields that rebuild the model
                      (`type(model)(config)`); checkpoints record it
    config_class      that dataclass (class attribute), for `build_model`
    block_types       the block classes (a class attribute, or an instance attribute
                      where they depend on the instance: the generic transformers
                      model's come from its architecture): the units FSDP2 shards,
                      activation checkpointing recomputes and `compile` compiles;
                      `()` shards and checkpoints the model as one unit
    init_parameter    fill one parameter's full (unsharded) tensor, by name

and, each only where a model needs it, one protocol per optional hook of the model
class (who calls it, when):

    InitBuffers            init_buffers(): non-persistent buffers (RoPE tables); `materialize`
    CountsParameters       num_parameters(): the banner (default: every parameter)
    CountsActiveParameters num_active_parameters(): what one token computes with (an MoE
                           decoder's k of E experts); the banner and `estimate`
    CountsFlops            flops_per_token(seq_len): MFU and `estimate` (default: 6 x N)
    DescribesItself        describe(): the banner ("native freetx decoder for qwen3")
    EstimatesActivations   activation_bytes(run): a micro-batch's activations; `estimate`
    HFLayoutModel          hf_layout: its HF transformers layout; conversion, HF loading
    ExtraForwards          fsdp_forward_methods: methods FSDP2 gathers for; `parallelize`
    AdapterTargets         adapter_targets: short name -> module suffix; `apply_lora`
    AlwaysTrained          always_trained: modules Spectrum always trains; `apply_peft`
    DecodesIncrementally   new_cache(left_padding, max_len), forward(cache=): generation
                           with a KV cache; the `generate` recipe
    PacksDocuments         attention_masks(documents), forward(documents=): packed
                           batches; refused before any work without it (`check_packing`)
    ShardsContext          context_masks(shard, documents, length), forward(context=):
                           distributed.cp > 1; refused before any work without it
    SplitsIntoStages       keep_blocks, held_elsewhere, forward_stage: distributed.pp > 1;
                           refused before any work without it
    SlicesLayers           tensor_parallel_plan(tp), slice_vocabulary: distributed.tp > 1;
                           refused before any work without it
    ProjectsInChunks       output_layer(), forward(output_loss=): the LM losses make the
                           logits a chunk of tokens at a time; every LM forward
    ReplacesLanguageHead   NEW_HEAD, LANGUAGE_HEAD: a head of its own (a scorer's) over a
                           language model's weights; `materialize` and the loaders

and one per hook of a submodule (an adapter layer, say), which receives local
shards only: `freetx.distributed` unwraps DTensors before calling and wraps again
after, so no model code touches one:

    SelfInitialized        own_parameters, reset_parameter(...): parameters the module
                           fills itself (adapters), also when the weights are loaded
    DerivedFromWeights     init_from_weights(local): values that follow from the final
                           weights (DoRA's magnitudes); after initialization or loading
    StoredInOwnForm        stores_parameter, stored_value(...), stored_element_bytes: a
                           parameter kept in another form (QLoRA's NF4 base); initialization,
                           loading and `estimate`
    SlicesWithLinear       tensor_parallel_dims(role): how tensor parallelism slices an
                           adapter around a sliced Linear
    FrozenInComputeDtype   frozen_in_compute_dtype: no fp32 master for its frozen
                           parameters; the frozen-base decision

Each protocol's docstring says the rest. The native decoder has its capabilities as
classes it lists among its bases (`freetx.models.decoder`): a model without one simply
does not follow that protocol.

`check_model` refuses, when a model is built or parallelized, a model class or module
that defines a near-miss of a hook's name (`init_buffer`): it would be silently ignored.

A model with a training term besides the logits (an MoE router's load-balancing loss)
returns `LMOutput(logits, aux_loss, metrics)` from forward in training mode; the
loss (`freetx.objectives.CrossEntropyLoss`) adds `aux_loss` per loss token and logs
`metrics`. Logits come first, so code that reads `output[0]` reads the logits.

A model with a latent code per position also follows `LatentModel` (`prior_codes`,
`posterior_codes`, `forward(..., codes=codes)`), which the `generate` recipe asks for.

Models are built on the meta device, parallelized, then materialized and initialized one
parameter at a time (`freetx.distributed.parameters.materialize`), so the initial weights
depend only on the seed, never on the world size.

A model family has one builder, `family(preset=None, **fields)`: a preset's fields (the
`PRESETS` table beside the model) with any field changed, or any shape from its fields
(`build_config`); `freetx validate` checks a config's keys against its `config_class`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn

from freetx.errors import CheckpointError, ConfigError
from freetx.models.memory import ActivationBytes, TrainingShape


@runtime_checkable
class HasBlocks(Protocol):
    """A model that names its blocks (the units FSDP2 shards; see `Model`): a class
    attribute, or an instance attribute where the blocks depend on the instance."""

    block_types: tuple[type[nn.Module], ...]


@runtime_checkable
class Model(HasBlocks, Protocol):
    """What freetx needs from a model (see the module docstring)."""

    config: Any
    config_class: ClassVar[type]

    def init_parameter(
        self, name: str, tensor: torch.Tensor, generator: torch.Generator
    ) -> None: ...


# -- optional hooks of a model class ---------------------------------------------------
@runtime_checkable
class InitBuffers(Protocol):
    """Non-persistent buffers to compute once the model has storage (RoPE tables).
    Called by `freetx.distributed.parameters.materialize` after the parameters are set."""

    def init_buffers(self) -> None: ...


@runtime_checkable
class CountsParameters(Protocol):
    """The model's own parameter count, for the banner (`num_parameters`)."""

    def num_parameters(self) -> int: ...


@runtime_checkable
class CountsActiveParameters(Protocol):
    """The parameters one token computes with (a mixture of experts: the chosen experts
    only), for the banner and `estimate` (`num_active_parameters`)."""

    def num_active_parameters(self) -> int: ...


@runtime_checkable
class CountsFlops(Protocol):
    """The model's own training FLOPs per token, for MFU and `estimate`."""

    def flops_per_token(self, seq_len: int) -> float: ...


@runtime_checkable
class DescribesItself(Protocol):
    """What the model is, in words, for the run's banner ("generic transformers path for
    gpt_neox")."""

    def describe(self) -> str: ...


@runtime_checkable
class EstimatesActivations(Protocol):
    """The model's own activation memory, for `estimate`: what a training micro-batch
    (`run`: its tokens, or a crosscoder's rows, and what of the run changes them) keeps at
    its peak in forward and backward, its loss, and what tp and cp move (freetx.models.memory)."""

    def activation_bytes(self, run: TrainingShape) -> ActivationBytes: ...


@runtime_checkable
class HFLayoutModel(Protocol):
    """A model (class) with an HF transformers layout (`freetx.models.hf.layout_of`):
    checkpoint conversion to and from HF folders."""

    hf_layout: ClassVar[Any]


@runtime_checkable
class ExtraForwards(Protocol):
    """Methods called instead of `forward` (a crosscoder's `reconstruct`), which FSDP2
    must gather the parameters for; `parallelize` registers them after sharding."""

    fsdp_forward_methods: ClassVar[tuple[str, ...]]


@runtime_checkable
class AdapterTargets(Protocol):
    """Short target names -> module name suffixes (q -> attention.wq), which
    `freetx.models.peft.resolve_targets` reads for peft.target_modules."""

    adapter_targets: ClassVar[dict[str, str]]


@runtime_checkable
class AlwaysTrained(Protocol):
    """Modules Spectrum trains whatever its selection says (embeddings, output head);
    read by `freetx.models.peft.apply_peft`."""

    always_trained: ClassVar[tuple[str, ...]]


@runtime_checkable
class DecodesIncrementally(Protocol):
    """A language model with a KV cache (the `generate` recipe; without it, a full forward
    per token). `new_cache(left_padding, max_len)` makes an empty cache for
    len(left_padding) rows of up to `max_len` tokens, row b left-padded with
    left_padding[b] tokens that no query sees, its positions counted from its first real
    token. `forward(input_ids, cache=cache)` takes the tokens after the cached ones
    ([B, T]: the prompts first, then one token per row at a time), returns their logits
    [B, T, vocab] in eval mode, and leaves them cached. The decoder's capability
    `IncrementalDecoding` (`freetx.models.decoder`); the Free Transformer has none."""

    def new_cache(self, left_padding: torch.Tensor, max_len: int) -> Any: ...


@runtime_checkable
class DecodesInBlocks(Protocol):
    """A language model the generation engine (`freetx.models.engine`) decodes over a
    paged KV cache: `block_cache_layers()` the number of layers whose entries the pool
    holds, or None where this model cannot be decoded so (a LongRoPE model, whose every
    key is computed again when a row grows past its short tables: the static batch serves
    it); `context_length()` the most tokens a row may hold (prompt and reply).
    `forward(input_ids, cache=rows)` with `rows` a `freetx.models.paged_cache.PagedRows`:
    each row's new tokens after its cached ones, their logits [B, T, vocab] in eval mode,
    their entries stored in the rows' blocks. The decoder's capability
    `IncrementalDecoding`."""

    def block_cache_layers(self) -> int | None: ...

    def context_length(self) -> int: ...


@runtime_checkable
class PacksDocuments(Protocol):
    """A language model that trains on packed batches: `forward(input_ids,
    documents=documents)`, `documents` [B, T] int64 the sample each position belongs to
    (0, 1, 2, ... within a row; -1 on padding), computes each sample as if it were alone
    (positions from 0, attention within the sample). `attention_masks(documents)` builds
    the per-layer masks that forward uses (the decoder's capability `DocumentMasks`)."""

    def attention_masks(self, documents: torch.Tensor) -> Any: ...


@runtime_checkable
class SequenceShard(Protocol):
    """This rank's part of every sequence under context parallelism, as a model sees it
    (`freetx.distributed.ContextShard` makes it; `ShardsContext` models take it):
    `indices(length)` the positions of a `length`-token sequence this rank holds
    (length / size of them, in order), `gather(x, dim)` every rank's part of `x` along
    `dim`, joined into the whole sequence in order (its backward sends each rank the
    gradient of its part), `sum(x)` `x` summed over the ranks (differentiable: what the
    whole sequence's tokens add up to, on every rank)."""

    size: int

    def indices(self, length: int, device: torch.device) -> torch.Tensor: ...

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor: ...

    def sum(self, x: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class ShardsContext(Protocol):
    """A language model that trains on a part of each sequence under context parallelism:
    `forward(input_ids, context=shard)` takes this rank's tokens ([B, T / cp], the
    positions `shard.indices(T)`; a packed batch's `documents` whole, [B, T]) and
    computes them exactly as the whole sequence would: attention over every rank's keys
    and values (`shard.gather`), RoPE at the tokens' positions, an MoE router's
    statistics over the whole sequence (`shard.sum`). `context_masks(shard, documents,
    length)` builds the per-layer masks that forward uses (the decoder's capability
    `ContextMasks`)."""

    def context_masks(
        self, shard: SequenceShard, documents: torch.Tensor | None, length: int
    ) -> Any: ...


@runtime_checkable
class SplitsIntoStages(Protocol):
    """A model that pipeline parallelism splits into stages of consecutive blocks.
    `keep_blocks(blocks, first, last)` drops what this rank's stages do not hold (other
    blocks, the embedding unless `first`, the final norm and head unless `last`), keeping
    the names of what stays (checkpoints load at any layout), and its parameter counts
    of the whole model. `forward_stage(x, *carry, blocks=range, documents=, output_loss=,
    context=)` computes one stage: from the input ids (first stage) or the previous
    stage's outputs, to the next stage's inputs (the hidden states, and what else must
    travel: an MoE model's router statistics), or at the last stage what forward returns.
    `held_elsewhere(name)`: whether a tensor of the whole model is another stage's (what
    loading weights and resuming leave to that stage). The decoder's capability
    `PipelineStages`."""

    def keep_blocks(self, blocks: list[int], first: bool, last: bool) -> None: ...

    def held_elsewhere(self, name: str) -> bool: ...

    def forward_stage(self, x: torch.Tensor, *carry: torch.Tensor, blocks: range, **inputs): ...


@runtime_checkable
class ReplacesLanguageHead(Protocol):
    """A model whose head replaces a language model's (a sequence scorer's `score`), so
    that its weights may come from a language model: the loaders do not read that model's
    head (`LANGUAGE_HEAD`: names in the weights this model has not), and `materialize`
    draws this one's (`NEW_HEAD`) from the seed, read instead where the weights have it."""

    NEW_HEAD: ClassVar[tuple[str, ...]]
    LANGUAGE_HEAD: ClassVar[tuple[str, ...]]


def refuse_scorer(model: nn.Module, what: str) -> None:
    """Refuse a model whose head replaces a language model's (a reward model's score) where
    `what` reads a language model's logits (a judge, generation, lm-eval tasks)."""
    if isinstance(model, ReplacesLanguageHead):
        raise ConfigError(
            f"{what} reads a language model's logits, and this {type(model).__name__} gives "
            "one score per sequence (a reward model).",
            fix="Point it at a language model (a causal LM's folder or run), not at a reward "
            "model's (rm_fsdp2's, or an XForSequenceClassification folder).",
        )


# -- optional hooks of a module (local shards only) -----------------------------------
@runtime_checkable
class SelfInitialized(Protocol):
    """A module that fills some of its parameters itself (an adapter's): `materialize`
    calls `reset_parameter(name, full, generator)` for each name in `own_parameters`,
    with the full tensor, also when the rest is loaded (no base file has them)."""

    own_parameters: ClassVar[tuple[str, ...]]

    def reset_parameter(
        self, name: str, tensor: torch.Tensor, generator: torch.Generator
    ) -> None: ...


@runtime_checkable
class DerivedFromWeights(Protocol):
    """A module with values that follow from the final weights (DoRA's magnitude):
    after initialization or loading, `init_from_weights(local)` gets its own
    parameters' local shards by name (FSDP2 shards them all by rows alike)."""

    def init_from_weights(self, local: dict[str, torch.Tensor]) -> None: ...


@runtime_checkable
class StoredInOwnForm(Protocol):
    """A module that keeps a parameter in another form (QLoRA's NF4 base), set from its
    full value only. `stored_value(name, full, shard)` returns what this rank keeps:
    the whole stored form (`shard` None), or rows `index` of `count` equal chunks
    (`shard` = (index, count)); `freetx.distributed.parameters` wraps it as the parameter;
    `stored_element_bytes(name)`: its bytes per element as stored, for `estimate`."""

    def stores_parameter(self, name: str) -> bool: ...

    def stored_element_bytes(self, name: str) -> float: ...

    def stored_value(
        self, name: str, full: torch.Tensor, shard: tuple[int, int] | None
    ) -> torch.Tensor: ...


@runtime_checkable
class FrozenInComputeDtype(Protocol):
    """A module whose frozen parameters are kept in the compute dtype (no fp32 master
    copy): the frozen-base decision (`freetx.distributed.frozen_base`) reads it."""

    frozen_in_compute_dtype: ClassVar[bool]


@runtime_checkable
class SlicesWithLinear(Protocol):
    """A Linear with parameters of its own (an adapter) that tensor parallelism slices as
    its base: `tensor_parallel_dims(role)` -> each parameter's name (dotted, within the
    module) -> the dimension sliced over the tp ranks, or None where every rank holds it
    whole, for a layer of `role` (colwise: the output rows; rowwise: the input columns).
    Raises ConfigError where it cannot be sliced."""

    def tensor_parallel_dims(self, role: str) -> dict[str, int | None]: ...


MODEL_HOOKS = (
    Model, HasBlocks, InitBuffers, CountsParameters, CountsActiveParameters, CountsFlops,
    DescribesItself, EstimatesActivations,
    HFLayoutModel, ExtraForwards, AdapterTargets, AlwaysTrained, DecodesIncrementally,
    PacksDocuments, ShardsContext, SplitsIntoStages,
)  # fmt: skip
MODULE_HOOKS = (
    SelfInitialized, DerivedFromWeights, StoredInOwnForm, FrozenInComputeDtype, SlicesWithLinear
)  # fmt: skip


def _hook_names() -> dict[str, str]:
    """Every protocol member -> the protocol that names it."""
    names = {}
    for protocol in (*MODEL_HOOKS, *MODULE_HOOKS):
        for member in (*protocol.__annotations__, *vars(protocol)):
            if not member.startswith("_"):
                names.setdefault(member, protocol.__name__)
    return names


HOOK_NAMES = _hook_names()


def _own_names(cls: type) -> set[str]:
    """The names a class (and its bases outside torch) defines, less torch's own."""
    torch_names: set[str] = {"reset_parameters"}  # nn layers' own initialization
    own: set[str] = set()
    for base in cls.__mro__:
        if base.__module__.startswith("torch") or base is object:
            torch_names.update(dir(base))
        else:
            own.update(vars(base))
    return {n for n in own if not n.startswith("__")} - torch_names


def require_hook(model: nn.Module | type, hook: type, cannot: str, fix: str) -> None:
    """Refuse a model (built, or the class a config builds: checked before launching) that
    does not follow `hook`, one of the protocols above: `"<class> <cannot>"`, and `fix`."""
    cls = model if isinstance(model, type) else type(model)
    if not issubclass(cls, hook):
        raise ConfigError(f"{cls.__name__} {cannot}", fix=fix)


def check_model(model: nn.Module) -> None:
    """Refuse a model whose class, or a module's, defines a near-miss of a hook name
    (`init_buffer` for `init_buffers`): freetx would silently never call it."""
    seen: set[type] = set()
    for module in model.modules():
        if type(module) in seen:
            continue
        seen.add(type(module))
        for name in sorted(_own_names(type(module))):
            if name in HOOK_NAMES:
                continue
            close = difflib.get_close_matches(name, HOOK_NAMES, n=1, cutoff=0.85)
            if close:
                hook = close[0]
                raise ConfigError(
                    f"{type(module).__qualname__} defines {name!r}, which freetx never "
                    f"calls; did you mean {hook!r} of the protocol {HOOK_NAMES[hook]} "
                    "(freetx.models.protocol)? Rename it, or give it a name further from "
                    "the hooks'."
                )


def num_parameters(model: nn.Module) -> int:
    """The model's own count (`num_parameters()`), else every parameter's elements."""
    if isinstance(model, CountsParameters):
        return model.num_parameters()
    return sum(p.numel() for p in model.parameters())


def num_active_parameters(model: nn.Module) -> int:
    """The parameters one token computes with: the model's own count, else all of them."""
    if isinstance(model, CountsActiveParameters):
        return model.num_active_parameters()
    return num_parameters(model)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: the model's own (`flops_per_token`), else 6 x parameters
    (forward + backward of every weight, attention left out)."""
    if isinstance(model, CountsFlops):
        return float(model.flops_per_token(seq_len))
    return 6.0 * num_parameters(model)


def training_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """The model's training FLOPs per token (`flops_per_token`: 6 per weight, forward and
    both gradients, plus attention's at `seq_len`) less the gradient a frozen weight does
    not get: 4 FLOPs per frozen weight instead of 6 (a LoRA run's base), in the share of
    the parameters that are frozen (counted over every parameter: exact for LoRA and QLoRA,
    whose base is all but the adapters; a few percent off where the embeddings train and
    blocks do not, Spectrum, or where the frozen share of an MoE's experts differs from
    the rest). For MFU and `freetx estimate`'s step time."""
    full = flops_per_token(model, seq_len)
    sizes = [(p.numel(), p.requires_grad) for p in model.parameters()]
    frozen = sum(n for n, trained in sizes if not trained) / max(sum(n for n, _ in sizes), 1)
    return full - frozen * flops_per_token(model, 0) / 3


class LMOutput(NamedTuple):
    """What a language model's forward returns when training adds a term of its own to the
    loss (the MoE decoder's router loss); plain logits otherwise."""

    logits: Any  # [B, T, vocab]; what `output_loss` returned when forward was given one
    aux_loss: torch.Tensor  # a scalar per token, already weighted: the loss adds it x tokens
    metrics: dict[str, torch.Tensor]  # scalars per token to log (detached): aux_loss, ...


class VocabSlice(Protocol):
    """This rank's slice of the vocabulary where tensor parallelism slices the head by
    vocabulary (`freetx.distributed.tensor_parallel` makes it): the head's logits are
    entries `start` .. `start` + their width of `vocab_size`; `max` and `sum` reduce a
    tensor over the ranks holding the other slices (no gradient), `gather` joins every
    slice's logits along the last dimension."""

    start: int

    def max(self, x: torch.Tensor) -> torch.Tensor: ...

    def sum(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather(self, x: torch.Tensor) -> torch.Tensor: ...


class OutputLayer(NamedTuple):
    """A language model's output layer as it hands it to a loss (`ProjectsInChunks`)."""

    # last hidden states [..., d] -> logits [..., vocab_size]: the head, and any soft-cap
    project: Callable[[torch.Tensor], torch.Tensor]
    parameters: tuple[torch.Tensor, ...]  # what project reads: gradients go to those that train
    vocab_size: int
    # sliced by vocabulary (tensor parallelism): project makes this rank's slice of the
    # logits, which the loss reduces over the slices (a vocabulary-parallel loss)
    vocab: VocabSlice | None = None


# What a language model's forward takes as `output_loss`: called with its last hidden
# states [B, T, d] (after the final norm) and its output layer, it returns what forward
# returns in place of the logits (a loss, say).
OutputLoss = Callable[[torch.Tensor, OutputLayer], Any]


@runtime_checkable
class ProjectsInChunks(Protocol):
    """A language model whose forward takes `output_loss` (an `OutputLoss`) and then
    returns `output_loss(hidden, self.output_layer())` in place of its logits, so that the
    loss computes the [B, T, vocab] logits a chunk of tokens at a time and never whole
    (`freetx.objectives.CrossEntropyLoss`, `num_chunks`). A model whose logits come whole
    (the generic transformers path) hands them over as `hidden` with an identity
    `project`. Called by the LM losses on every training and evaluation forward; inside
    forward, so that FSDP2 holds the output layer's gathered weights."""

    def output_layer(self) -> OutputLayer: ...


# The roles of a module in a tensor-parallel plan (`SlicesLayers`), as
# `freetx.distributed.apply_tensor_parallel` applies them:
#   colwise    a Linear's output features sliced (a slice of the heads, of the MLP's
#              hidden units); its output stays sliced for the rowwise one after it
#   rowwise    a Linear's input features sliced; the outputs summed over the ranks
#   embedding  an Embedding's vocabulary rows sliced; the outputs summed
#   output     the head's vocabulary rows sliced; each rank makes its slice of the logits
#   heads_norm a norm applied per head ([B, T, heads, head_dim], heads sliced): its weight
#              whole on every rank, its gradient summed over them
# and, with sequence parallelism (the residual stream between the sliced layers sliced
# by sequence over the ranks: [B, T / tp, hidden] each):
#   sequence_norm      a norm of the residual stream, on this rank's tokens
#   gather_sequence    a module whose first input is the residual stream, gathered whole
#                      before it (attention, a dense MLP, the final norm)
#   gather_experts     an MoE block: its input gathered whole, its output sliced again
#   rowwise_sequence   rowwise, its outputs summed and scattered by sequence
#   embedding_sequence embedding, its outputs summed and scattered by sequence
#   split_sequence     a whole embedding (tied to the head): its output sliced by sequence
TP_ROLES = ("colwise", "rowwise", "embedding", "output", "heads_norm", "sequence_norm",
            "gather_sequence", "gather_experts", "rowwise_sequence", "embedding_sequence",
            "split_sequence")  # fmt: skip


@runtime_checkable
class SlicesLayers(Protocol):
    """A model whose layers can be sliced over `tp` tensor-parallel ranks: module name ->
    role (`TP_ROLES`); raises ConfigError, naming the fix, for a `tp` the model cannot
    take (heads not divisible, a layer kind it cannot slice). `parallelize`, when
    `distributed.tp` > 1, before activation checkpointing and FSDP2. The model's code
    sees local slices (its attention reshapes by head_dim, never by the head count).
    A head sliced by vocabulary makes this rank's slice of the logits: its output layer
    hands the `VocabSlice` to the loss (no logits gathered); `head` gathers them whole."""

    def tensor_parallel_plan(self, tp: int, sequence_parallel: bool = False) -> dict[str, str]: ...

    def slice_vocabulary(self, vocab: VocabSlice) -> None:
        """Called by tensor parallelism where the plan slices the head by vocabulary
        ("output"): the model's output layer says so to the loss (`OutputLayer.vocab`)."""


@runtime_checkable
class LatentModel(Protocol):
    """A model whose forward takes a latent code per position (`codes` [B, T, ...], as
    `prior_codes` returns them; the Free Transformer's: H bits). A sampler draws each
    position's code once and keeps it."""

    def prior_codes(self, count: int, length: int, generator: torch.Generator) -> torch.Tensor: ...

    def posterior_codes(
        self, input_ids: torch.Tensor, generator: torch.Generator
    ) -> torch.Tensor: ...


def build_config(
    config_class: type,
    fields: dict[str, Any],
    preset: str | None = None,
    presets: dict[str, dict[str, Any]] | None = None,
) -> Any:
    """A model config: the preset's fields, then `fields` over them.

    Raises ValueError (shown by `instantiate` as a config error naming the
    model node) for an unknown preset or field, with the valid names.
    """
    presets = presets or {}
    if preset is not None and preset not in presets:
        raise ValueError(f"unknown preset {preset!r}; the presets are: {', '.join(presets)}")
    names = [f.name for f in dataclasses.fields(config_class)]
    unknown = [k for k in fields if k not in names]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, names, n=1)
            hints.append(f"'{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        raise ValueError(
            f"{config_class.__name__} has no field {', '.join(hints)}; its fields: "
            f"{', '.join(names)}"
        )
    values = {**(presets[preset] if preset is not None else {}), **fields}
    return config_class(**values)


def builds(
    config_class: type,
    presets: dict[str, dict[str, Any]] | None = None,
    config_for: Callable[[dict[str, Any]], tuple[type, str]] | None = None,
):
    """Mark a family's builder with its config class (and its `preset:` fields), so that
    config keys and values can be checked against the config's fields before anything is
    built (`freetx validate`). `config_for`: for a builder whose config class depends on
    its arguments, the class it picks for them and why (`freetx.fields.ChoosesConfig`)."""

    def mark(builder):
        builder.config_class = config_class
        builder.presets = presets or {}
        if config_for is not None:
            builder.config_for = config_for
        return builder

    return mark


def model_class(dotted: str) -> type:
    """A model class from its dotted path (as a checkpoint's meta.json records it)."""
    module_name, _, class_name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError):
        raise CheckpointError(
            f"the checkpoint names the model class {dotted}, which cannot be imported."
        ) from None


def build_model(dotted_class: str, config: dict[str, Any]) -> nn.Module:
    """A model from its class path and config fields (as a checkpoint's meta.json records)."""
    cls = model_class(dotted_class)
    model = cls(cls.config_class(**config))
    check_model(model)
    return model

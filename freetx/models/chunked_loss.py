"""Losses over an output layer's logits made a chunk of tokens at a time.

The output layer's logits [B, T, vocab] are the largest tensor of a step at Llama 3's
128k or Gemma's 256k vocabulary. A model that hands its last hidden states and its output
layer (`ProjectsInChunks`) to an `OutputLoss` of this module never makes them whole. One
engine serves every such loss: `over_chunks` makes the logits of one chunk of tokens at a
time in the compute dtype, upcasts that chunk to float32, and hands it to a `ChunkTerm`,
which says what the chunk gives (its sums, its per-token values, and the gradient of its
part of the loss in those logits): here the labels' cross-entropy, in
`freetx.objectives.distillation` the divergence from a teacher's chunk.

`_GradientInForward` takes each chunk's gradients (of the hidden states and of the
output layer's parameters) at once, back through the output layer from the term's
gradient in its logits, so that nothing of the chunk is kept for backward. Backward then
only scales the gradients by the loss's own: the same matrix products as the unchunked
loss, with one chunk's logits alive at a time (`benchmarks/memory.py`). The LM losses use
it through `ChunkedCrossEntropy` (`freetx.objectives.CrossEntropyLoss`, the Free
Transformer's), distillation through its own term.

`ChunkedLogProbs` returns each token's log-probability instead, for the preference
losses (`freetx.objectives.preference`): their gradient in each token is known only in
backward (`_GradientInBackward`), which makes each chunk's logits a second time
(`benchmarks/dpo.py`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from freetx.models.protocol import OutputLayer, VocabSlice

IGNORE_INDEX = -100  # torch's cross-entropy default, as in freetx.data

# The vocabulary size from which `num_chunks` defaults to CHUNKS_FOR_LARGE_VOCABULARY:
# below it (Llama 2's and Mistral's 32k, byte vocabularies) the logits are smaller than
# a block's activations and one chunk keeps the loss as it always was.
LARGE_VOCABULARY = 65_536
CHUNKS_FOR_LARGE_VOCABULARY = 8


def check_num_chunks(num_chunks: int | None) -> int | None:
    """A loss's `num_chunks` (None: by vocabulary), refused below 1; the LM losses' own
    check when they are built (before any model is)."""
    found = num_chunks_problem({"num_chunks": num_chunks})
    if found:
        raise ValueError(f"num_chunks={num_chunks}: {found['num_chunks']}")
    return num_chunks


def num_chunks_problem(values: dict[str, Any]) -> dict[str, str]:
    """An LM loss's `num_chunks` below 1, by key: why, and the fix (the losses'
    `meaningless`: `freetx validate` and every run check a config's `loss:` node with it
    before anything is built)."""
    chunks = values.get("num_chunks")
    if isinstance(chunks, int) and chunks < 1:
        return {
            "num_chunks": "the logits are made that many chunks of tokens at a time; set 1 or "
            "more, or null (by the vocabulary size)."
        }
    return {}


def default_num_chunks(vocab_size: int) -> int:
    """`num_chunks` when a config leaves it out: by the vocabulary size."""
    return CHUNKS_FOR_LARGE_VOCABULARY if vocab_size >= LARGE_VOCABULARY else 1


def chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """The (start, end) rows of `chunks` near-equal chunks of `n` (torch's `tensor_split`
    sizes: the first `n % chunks` one row longer), empty ones left out. From sizes alone,
    never a tensor's values: the loss runs on fake tensors too (`freetx estimate --measure`)."""
    size, longer = divmod(n, chunks)
    bounds, start = [], 0
    for i in range(chunks):
        end = start + size + (i < longer)
        if end > start:
            bounds.append((start, end))
        start = end
    return bounds


class Chunk(NamedTuple):
    """What a `ChunkTerm` makes of one chunk of tokens' logits."""

    sums: tuple[torch.Tensor, ...]  # its values summed over the chunk (float32, detached)
    per_token: tuple[torch.Tensor, ...]  # its values at each of the chunk's tokens [n, ...]
    grad: torch.Tensor | None  # where asked: its part of the loss's gradient in the logits


class ChunkTerm(Protocol):
    """A loss over an output layer's logits, a chunk of tokens at a time (`over_chunks`).

    `chunk` gets a chunk's logits [n, V] float32 (detached; this rank's slice [n, V/tp]
    where `vocab` slices the head), its `rows` of the flat tokens, and whether to
    `differentiate`: then `Chunk.grad` is the gradient in those logits of the chunk's part
    of the loss, sum_i weights[i] x sums[i]; given `upstream` (each token's gradient [n],
    where it is known only in backward: `_GradientInBackward`), that of its per-token
    value weighted by it instead."""

    # each of its sums' weight in the loss (`loss_in_chunks`); none for a term of per-token
    # values only, which `over_chunks` runs alone (the teacher's top-k)
    weights: tuple[float, ...]

    def chunk(
        self,
        logits: torch.Tensor,
        rows: slice,
        vocab: VocabSlice | None,
        differentiate: bool,
        upstream: torch.Tensor | None,
    ) -> Chunk: ...


class OverChunks(NamedTuple):
    """What `over_chunks` returns: a term's sums and per-token values over all the flat
    tokens, and the gradients it took (float32 sums over the chunks for the parameters)."""

    sums: tuple[torch.Tensor, ...]
    per_token: tuple[torch.Tensor, ...]
    grad_hidden: torch.Tensor | None  # [N, d], None where hidden was not differentiated
    grad_params: list[torch.Tensor]


def over_chunks(
    hidden: torch.Tensor,
    layer: OutputLayer,
    chunks: int,
    term: ChunkTerm,
    wants: tuple[torch.Tensor, ...] = (),
    upstream: torch.Tensor | None = None,
) -> OverChunks:
    """The chunk loop: each chunk of tokens of `hidden` [..., d] in turn, its logits
    (`layer.project`), upcast to float32, and `term`'s `Chunk` of them; with `wants`
    (hidden, then the parameters to differentiate), that chunk's gradients at once, from
    the term's gradient in its logits back through `project`, so that nothing of the chunk
    outlives it. `upstream` [N]: each flat token's gradient of the term's per-token value.
    At least one chunk (an empty one without tokens) gives the sums their shapes."""
    flat_hidden = hidden.flatten(0, -2)
    tokens = flat_hidden.shape[0]
    wants_hidden = bool(wants) and wants[0] is hidden
    params = list(wants[1:] if wants_hidden else wants)
    grad_hidden = torch.empty_like(flat_hidden) if wants_hidden else None
    # float32 sums of the parameters' gradients over the chunks
    # (zeros_like: a parameter sliced over tensor-parallel ranks is a DTensor, its sum too)
    grad_params = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    sums: list[torch.Tensor] = []
    per_token: list[torch.Tensor] = []
    for start, end in chunk_bounds(tokens, chunks) or [(0, tokens)]:
        chunk = flat_hidden[start:end].detach().requires_grad_(wants_hidden)
        inputs = ([chunk] if wants_hidden else []) + params
        with torch.enable_grad() if wants else torch.no_grad():
            # a view, not the leaf itself: a hook on a module's input (torch's memory
            # trackers') may not stand on a leaf that autograd.grad differentiates
            logits = layer.project(chunk.view_as(chunk)).float()
        rows = slice(start, end)
        above = None if upstream is None else upstream[rows]
        part = term.chunk(logits.detach(), rows, layer.vocab, bool(inputs), above)
        if start == 0:  # the first chunk: the term's values' shapes
            sums = [torch.zeros_like(value) for value in part.sums]
            per_token = [value.new_empty((tokens, *value.shape[1:])) for value in part.per_token]
        for summed, value in zip(sums, part.sums):
            summed += value
        for whole, value in zip(per_token, part.per_token):
            whole[rows] = value
        if inputs:
            grads = torch.autograd.grad(logits, inputs, part.grad)
            if wants_hidden:
                grad_hidden[rows] = grads[0]
                grads = grads[1:]
            for summed, grad in zip(grad_params, grads):
                summed += grad
    return OverChunks(tuple(sums), tuple(per_token), grad_hidden, grad_params)


def _outputs(term: ChunkTerm, found: OverChunks) -> tuple[torch.Tensor, ...]:
    """(loss, *sums, *per-token values): the loss the term's sums weighed."""
    weighted = [weight * summed for weight, summed in zip(term.weights, found.sums)]
    return sum(weighted[1:], weighted[0]), *found.sums, *found.per_token


class _GradientInForward(torch.autograd.Function):
    """A term's loss over the chunks and, in the same pass, its gradients (the loss's
    gradient taken as one); backward scales them by the loss's real gradient (a scalar).
    Returns (loss, *sums, *per-token values), the loss alone differentiable."""

    @staticmethod
    def forward(ctx, hidden, layer, chunks, term, *params):
        wants = ((hidden,) if ctx.needs_input_grad[0] else ()) + params
        found = over_chunks(hidden, layer, chunks, term, wants)
        ctx.mark_non_differentiable(*found.sums, *found.per_token)
        ctx.hidden_shape = hidden.shape
        ctx.param_dtypes = [p.dtype for p in params]
        grad_hidden = found.grad_hidden
        ctx.save_for_backward(
            grad_hidden if grad_hidden is not None else torch.empty(0), *found.grad_params
        )
        ctx.has_hidden = grad_hidden is not None
        return _outputs(term, found)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total, *_not_differentiable):
        grad_hidden, *grad_params = ctx.saved_tensors
        scaled_hidden = None
        if ctx.has_hidden:
            scaled_hidden = (grad_hidden * grad_total.to(grad_hidden.dtype)).view(ctx.hidden_shape)
        scaled = [(g * grad_total).to(dtype) for g, dtype in zip(grad_params, ctx.param_dtypes)]
        return scaled_hidden, None, None, None, *scaled


class _GradientInBackward(torch.autograd.Function):
    """A term of one per-token value, differentiable in it for any gradient of each token's
    (DPO's loss is not linear in them, so nothing can be computed ahead in forward):
    forward keeps no chunk; backward makes the chunks' logits again and takes their
    gradients weighted by each token's (`over_chunks` with `upstream`). Returns (loss,
    *sums, per-token values), the last alone differentiable."""

    @staticmethod
    def forward(ctx, hidden, layer, chunks, term, *params):
        outputs = _outputs(term, over_chunks(hidden, layer, chunks, term))
        ctx.mark_non_differentiable(*outputs[:-1])
        ctx.layer, ctx.chunks, ctx.term = layer, chunks, term
        ctx.param_dtypes = [p.dtype for p in params]
        ctx.save_for_backward(hidden, *params)
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        hidden, *params = ctx.saved_tensors
        wants = ((hidden,) if ctx.needs_input_grad[0] else ()) + tuple(params)
        upstream = grad_outputs[-1].float()
        found = over_chunks(hidden, ctx.layer, ctx.chunks, ctx.term, wants, upstream)
        grad_hidden = found.grad_hidden
        if grad_hidden is not None:
            grad_hidden = grad_hidden.view(hidden.shape)
        grads = [g.to(dtype) for g, dtype in zip(found.grad_params, ctx.param_dtypes)]
        return grad_hidden, None, None, None, *grads


def loss_in_chunks(
    hidden: torch.Tensor,
    layer: OutputLayer,
    chunks: int,
    term: ChunkTerm,
    gradient: type[torch.autograd.Function] = _GradientInForward,
) -> tuple[torch.Tensor, ...]:
    """`term`'s (loss, *sums, *per-token values) over the logits `layer` makes of
    `hidden` [B, T, d], `chunks` chunks of tokens at a time: through `gradient`
    (`_GradientInForward`, or `_GradientInBackward`) where anything trains, differentiable
    in `hidden` and the layer's trained parameters; plainly where nothing does (under
    no_grad, a frozen model)."""
    trained = [p for p in layer.parameters if p.requires_grad]
    if torch.is_grad_enabled() and (hidden.requires_grad or trained):
        return gradient.apply(hidden, layer, chunks, term, *trained)
    return _outputs(term, over_chunks(hidden, layer, chunks, term))


def sliced_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, vocab: VocabSlice
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy over logits sliced by vocabulary: `logits` [N, V/tp] float32, this
    rank's slice (`vocab`); each token's loss [N] (0 where ignored) and its gradient in
    these logits (softmax minus the label's one-hot, on this slice), from the log-sum-exp
    and the label's logit reduced over the slices: no logits are gathered."""
    with torch.no_grad():
        peak = vocab.max(logits.max(dim=-1).values)
        exp = (logits - peak[:, None]).exp()
        sum_exp = vocab.sum(exp.sum(dim=-1))
        local = labels - vocab.start
        here = (local >= 0) & (local < logits.shape[-1])
        mine = logits.gather(1, local.clamp(0, logits.shape[-1] - 1)[:, None])[:, 0]
        target = vocab.sum(torch.where(here, mine, 0.0))
        valid = labels != ignore_index
        losses = torch.where(valid, peak + sum_exp.log() - target, 0.0)
        grad = exp / sum_exp[:, None]
        # minus the label's one-hot on this slice (a scatter: no data-dependent shapes)
        grad.scatter_add_(
            1, local.clamp(0, logits.shape[-1] - 1)[:, None], -here[:, None].to(grad.dtype)
        )
        grad *= valid[:, None]
    return losses, grad


class _WholeVocabulary:
    """The `VocabSlice` of an unsliced head: one slice, the whole vocabulary; nothing to
    reduce (so that one code path serves both)."""

    start = 0

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x


WHOLE_VOCABULARY = _WholeVocabulary()


def log_sum_exp(logits: torch.Tensor, vocab: VocabSlice) -> torch.Tensor:
    """Each row's log-sum-exp over the whole vocabulary, from this rank's slice [N, V/tp]
    (no gradient)."""
    with torch.no_grad():
        peak = vocab.max(logits.max(dim=-1).values)
        return peak + vocab.sum((logits - peak[:, None]).exp().sum(dim=-1)).log()


class TokenLosses(NamedTuple):
    """What the cross-entropy of a batch returns: the loss summed over its loss tokens
    (differentiable) and each token's loss [B, T] (detached, 0 where ignored), or None
    where it was not asked for."""

    total: torch.Tensor
    per_token: torch.Tensor | None


class _OverChunksOfTokens:
    """What the chunked output losses share: the labels [B, T] and how many chunks of
    tokens at a time (None: `default_num_chunks`); a call makes the logits whole only for
    one chunk of an unsliced head (`whole`), else is the `ChunkTerm` of `loss_in_chunks`
    (each token's cross-entropy of its label) through the loss's `gradient`; `finish`
    makes what forward returns of (total, per-token losses)."""

    weights = (1.0,)
    gradient: type[torch.autograd.Function]  # the subclass's: where its gradient is taken

    def __init__(
        self, labels: torch.Tensor, num_chunks: int | None = None, ignore_index: int = IGNORE_INDEX
    ) -> None:
        self.labels = labels
        self.num_chunks = num_chunks
        self.ignore_index = ignore_index

    def __call__(self, hidden: torch.Tensor, layer: OutputLayer):
        chunks = self.num_chunks or default_num_chunks(layer.vocab_size)
        if chunks == 1 and layer.vocab is None:
            return self.whole(layer.project(hidden))
        total, _, per_token = loss_in_chunks(hidden, layer, chunks, self, self.gradient)
        return self.finish(total, per_token)

    def chunk(self, logits, rows: slice, vocab: VocabSlice | None, differentiate, upstream):
        """A chunk's cross-entropy of its labels (`ChunkTerm`): torch's over an unsliced
        head, its gradient through torch's backward; else `sliced_cross_entropy`'s."""
        labels = self.labels.flatten()[rows]
        if vocab is not None:  # this rank's slice of the vocabulary; the gradient at hand
            losses, grad = sliced_cross_entropy(logits, labels, self.ignore_index, vocab)
            if upstream is not None:
                grad *= upstream[:, None]
        else:
            logits.requires_grad_(differentiate)
            with torch.enable_grad() if differentiate else torch.no_grad():
                losses = F.cross_entropy(
                    logits, labels, ignore_index=self.ignore_index, reduction="none"
                )
                of = losses.sum() if upstream is None else losses
                grad = torch.autograd.grad(of, logits, upstream)[0] if differentiate else None
            losses = losses.detach()
        return Chunk((losses.sum(),), (losses,), grad if differentiate else None)


class ChunkedCrossEntropy(_OverChunksOfTokens):
    """An `OutputLoss` (`freetx.models.OutputLoss`): next-token cross-entropy of `labels`
    [B, T] over the logits the output layer makes of `hidden` [B, T, d], `num_chunks`
    chunks of tokens at a time (None: `default_num_chunks`). `per_token`: also return
    each token's loss."""

    gradient = _GradientInForward

    def __init__(
        self,
        labels: torch.Tensor,
        num_chunks: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        per_token: bool = False,
    ) -> None:
        super().__init__(labels, num_chunks, ignore_index)
        self.per_token = per_token

    def finish(self, total: torch.Tensor, per_token: torch.Tensor) -> TokenLosses:
        return TokenLosses(total, per_token.view_as(self.labels) if self.per_token else None)

    def whole(self, logits: torch.Tensor) -> TokenLosses:
        """The loss of logits made whole (one chunk), upcast to float32 for the softmax."""
        flat = logits.float().flatten(0, 1), self.labels.flatten()
        if not self.per_token:
            return TokenLosses(
                F.cross_entropy(*flat, ignore_index=self.ignore_index, reduction="sum"), None
            )
        losses = F.cross_entropy(*flat, ignore_index=self.ignore_index, reduction="none")
        return TokenLosses(losses.sum(), losses.detach().view_as(self.labels))


class ChunkedLogProbs(_OverChunksOfTokens):
    """An `OutputLoss` (`freetx.models.OutputLoss`): each token's log-probability of its
    label, [B, T] float32 (0 where the label is `ignore_index`), over the logits the output
    layer makes of `hidden` [B, T, d], `num_chunks` chunks of tokens at a time (None:
    `default_num_chunks`); the preference losses sum them per sequence
    (`freetx.objectives.sequence_logps`).

    Differentiable in `hidden` and the layer's trained parameters, for any gradient of
    each token's log-probability (`_GradientInBackward`: unlike `ChunkedCrossEntropy`'s,
    nothing can be computed ahead in forward): forward keeps no chunk; backward makes each
    chunk's logits again and takes their gradient, the one-hot minus the softmax times
    the token's weight, back through `project`. Without gradients (a reference model
    under no_grad) it is the chunked forward alone."""

    gradient = _GradientInBackward

    def finish(self, _total: torch.Tensor, per_token: torch.Tensor) -> torch.Tensor:
        return -per_token.view_as(self.labels)

    def whole(self, logits: torch.Tensor) -> torch.Tensor:
        """The log-probabilities of logits made whole (one chunk), upcast to float32."""
        flat = logits.float().flatten(0, 1), self.labels.flatten()
        losses = F.cross_entropy(*flat, ignore_index=self.ignore_index, reduction="none")
        return -losses.view_as(self.labels)


class SumsBySource(Protocol):
    """A batch's rows by source (a mixture's: `freetx.data.SourcesOf`): the sums of a
    per-token loss it adds to a loss's extras, by source name."""

    def sums(self, per_token: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]: ...


def forward_with_loss(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    num_chunks: int | None,
    ignore_index: int = IGNORE_INDEX,
    sources: SumsBySource | None = None,
    **inputs,
):
    """`model`'s forward with a `ChunkedCrossEntropy` of `labels` as its output loss:
    (what forward returned, its `TokenLosses`, and `sources`' per-source sums or {}).
    The losses stand where the logits would: the output itself, or its first element
    (`LMOutput`, the Free Transformer's (logits, z_logits))."""
    head = ChunkedCrossEntropy(labels, num_chunks, ignore_index, per_token=sources is not None)
    output = model(input_ids, output_loss=head, **inputs)
    losses = output if isinstance(output, TokenLosses) else output[0]
    sums = {} if sources is None else sources.sums(losses.per_token, labels != ignore_index)
    return output, losses, sums

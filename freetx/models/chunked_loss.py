"""Cross-entropy over an output layer's logits made a chunk of tokens at a time.

The output layer's logits [B, T, vocab] are the largest tensor of a step at Llama 3's
128k or Gemma's 256k vocabulary. `ChunkedCrossEntropy` is an `OutputLoss`: a model
that hands it its last hidden states and its output layer (`ProjectsInChunks`) never
makes the logits whole. It computes the logits of one chunk of tokens at a time in the
compute dtype, upcasts that chunk to float32, takes its cross-entropy, and computes
that chunk's gradients (of the hidden states and of the output layer's parameters) at
once, so that nothing of the chunk is kept for backward. Backward then only scales the
gradients by the loss's own: the same matrix products as the unchunked loss, with one
chunk's logits alive at a time (`benchmarks/memory.py`). The LM losses use it:
`freetx.objectives.CrossEntropyLoss`, the Free Transformer's.

`ChunkedLogProbs` returns each token's log-probability instead, for the preference
losses (`freetx.objectives.preference`): their gradient in each token is known only in
backward, which makes each chunk's logits a second time (`benchmarks/dpo.py`).
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


class TokenLosses(NamedTuple):
    """What the cross-entropy of a batch returns: the loss summed over its loss tokens
    (differentiable) and each token's loss [B, T] (detached, 0 where ignored), or None
    where it was not asked for."""

    total: torch.Tensor
    per_token: torch.Tensor | None


class _OverChunksOfTokens:
    """What the chunked output losses share: the labels [B, T] and how many chunks of
    tokens at a time (None: `default_num_chunks`); a call makes the logits whole only for
    one chunk of an unsliced head (`whole`), else runs `_chunk_losses`: through the
    loss's own autograd function (`differentiate`) where anything trains, plainly where
    nothing does (under no_grad, a frozen model); `finish` makes what forward returns of
    (total, per-token losses)."""

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
        trained = [p for p in layer.parameters if p.requires_grad]
        args = (hidden, self.labels, (layer.project, layer.vocab), chunks, self.ignore_index)
        if torch.is_grad_enabled() and (hidden.requires_grad or trained):
            return self.finish(*self.differentiate(*args, *trained))
        return self.finish(*_chunk_losses(*args, ())[:2])


class ChunkedCrossEntropy(_OverChunksOfTokens):
    """An `OutputLoss` (`freetx.models.OutputLoss`): next-token cross-entropy of `labels`
    [B, T] over the logits the output layer makes of `hidden` [B, T, d], `num_chunks`
    chunks of tokens at a time (None: `default_num_chunks`). `per_token`: also return
    each token's loss."""

    def __init__(
        self,
        labels: torch.Tensor,
        num_chunks: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        per_token: bool = False,
    ) -> None:
        super().__init__(labels, num_chunks, ignore_index)
        self.per_token = per_token

    def differentiate(self, *args):
        return _ChunkedCrossEntropy.apply(*args)

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


def _chunk_losses(hidden, labels, head, chunks: int, ignore_index: int, wants, weights=None):
    """Each chunk of tokens in turn: its logits, upcast, cross-entropy; with `wants`
    (hidden, then the parameters to differentiate), that chunk's gradients at once: of the
    losses' sum, or, given `weights` [N] (the flat tokens'), of their weighted sum.
    `head`: (project, its `VocabSlice` or None). Returns (total, per-token losses,
    gradient of hidden or None, of each parameter)."""
    project, vocab = head
    flat_hidden, flat_labels = hidden.flatten(0, -2), labels.flatten()
    wants_hidden = bool(wants) and wants[0] is hidden
    params = list(wants[1:] if wants_hidden else wants)
    grad_hidden = torch.empty_like(flat_hidden) if wants_hidden else None
    # float32 sums of the parameters' gradients over the chunks
    # (zeros_like: a parameter sliced over tensor-parallel ranks is a DTensor, its sum too)
    grad_params = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    per_token = torch.empty(flat_labels.shape, dtype=torch.float32, device=hidden.device)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start, end in chunk_bounds(flat_labels.numel(), chunks):
        chunk = flat_hidden[start:end].detach().requires_grad_(wants_hidden)
        inputs = ([chunk] if wants_hidden else []) + params
        with torch.enable_grad() if wants else torch.no_grad():
            # a view, not the leaf itself: a hook on a module's input (torch's memory
            # trackers') may not stand on a leaf that autograd.grad differentiates
            logits = project(chunk.view_as(chunk)).float()
            if vocab is None:
                losses = F.cross_entropy(
                    logits, flat_labels[start:end], ignore_index=ignore_index, reduction="none"
                )
                loss = losses.sum()
                of, scale = (loss, None) if weights is None else (losses, weights[start:end])
                grads = torch.autograd.grad(of, inputs, scale) if inputs else ()
            else:  # this rank's slice of the vocabulary; the gradient in its logits at hand
                losses, grad = sliced_cross_entropy(
                    logits, flat_labels[start:end], ignore_index, vocab
                )
                loss = losses.sum()
                if weights is not None:
                    grad *= weights[start:end, None]
                grads = torch.autograd.grad(logits, inputs, grad) if inputs else ()
        if wants_hidden:
            grad_hidden[start:end] = grads[0]
            grads = grads[1:]
        for summed, grad in zip(grad_params, grads):
            summed += grad
        per_token[start:end] = losses.detach()
        total += loss.detach()
    return total, per_token, grad_hidden, grad_params


class _ChunkedCrossEntropy(torch.autograd.Function):
    """The chunked loss and, in the same pass, its gradients (the loss's gradient taken as
    one); backward scales them by the loss's real gradient (a scalar)."""

    @staticmethod
    def forward(ctx, hidden, labels, head, chunks, ignore_index, *params):
        wants = ((hidden,) if ctx.needs_input_grad[0] else ()) + params
        total, per_token, grad_hidden, grad_params = _chunk_losses(
            hidden, labels, head, chunks, ignore_index, wants
        )
        ctx.mark_non_differentiable(per_token)
        ctx.hidden_shape = hidden.shape
        ctx.param_dtypes = [p.dtype for p in params]
        ctx.save_for_backward(
            grad_hidden if grad_hidden is not None else torch.empty(0), *grad_params
        )
        ctx.has_hidden = grad_hidden is not None
        return total, per_token

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total, _grad_per_token):
        grad_hidden, *grad_params = ctx.saved_tensors
        scaled_hidden = None
        if ctx.has_hidden:
            scaled_hidden = (grad_hidden * grad_total.to(grad_hidden.dtype)).view(ctx.hidden_shape)
        scaled = [(g * grad_total).to(dtype) for g, dtype in zip(grad_params, ctx.param_dtypes)]
        return scaled_hidden, None, None, None, None, *scaled


class ChunkedLogProbs(_OverChunksOfTokens):
    """An `OutputLoss` (`freetx.models.OutputLoss`): each token's log-probability of its
    label, [B, T] float32 (0 where the label is `ignore_index`), over the logits the output
    layer makes of `hidden` [B, T, d], `num_chunks` chunks of tokens at a time (None:
    `default_num_chunks`); the preference losses sum them per sequence
    (`freetx.objectives.sequence_logps`).

    Differentiable in `hidden` and the layer's trained parameters, for any gradient of
    each token's log-probability (DPO's loss is not linear in them, so, unlike
    `ChunkedCrossEntropy`, nothing can be computed ahead in forward): forward keeps no
    chunk; backward makes each chunk's logits again and takes their gradient, the
    one-hot minus the softmax times the token's weight, back through `project`. Without
    gradients (a reference model under no_grad) it is the chunked forward alone."""

    def differentiate(self, *args):
        return _ChunkedLogProbs.apply(*args)

    def finish(self, _total: torch.Tensor, per_token: torch.Tensor) -> torch.Tensor:
        return -per_token.view_as(self.labels)

    def whole(self, logits: torch.Tensor) -> torch.Tensor:
        """The log-probabilities of logits made whole (one chunk), upcast to float32."""
        flat = logits.float().flatten(0, 1), self.labels.flatten()
        losses = F.cross_entropy(*flat, ignore_index=self.ignore_index, reduction="none")
        return -losses.view_as(self.labels)


class _ChunkedLogProbs(torch.autograd.Function):
    """The chunked losses (total, each token's: minus its log-probability); backward makes
    the chunks' logits again and takes their gradients weighted by each token's
    (`_chunk_losses` with `weights`)."""

    @staticmethod
    def forward(ctx, hidden, labels, head, chunks, ignore_index, *params):
        total, per_token = _chunk_losses(hidden, labels, head, chunks, ignore_index, ())[:2]
        ctx.mark_non_differentiable(total)
        ctx.head, ctx.chunks, ctx.ignore_index = head, chunks, ignore_index
        ctx.param_dtypes = [p.dtype for p in params]
        ctx.save_for_backward(hidden, labels, *params)
        return total, per_token

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _grad_total, grad_per_token):
        hidden, labels, *params = ctx.saved_tensors
        wants = ((hidden,) if ctx.needs_input_grad[0] else ()) + tuple(params)
        weights = grad_per_token.float()
        _, _, grad_hidden, grad_params = _chunk_losses(
            hidden, labels, ctx.head, ctx.chunks, ctx.ignore_index, wants, weights
        )
        if grad_hidden is not None:
            grad_hidden = grad_hidden.view(hidden.shape)
        grads = [g.to(dtype) for g, dtype in zip(grad_params, ctx.param_dtypes)]
        return grad_hidden, None, None, None, None, *grads


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

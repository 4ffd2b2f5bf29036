"""Log-probabilities of a model's labels, never through its whole logits: per token
(`token_logps`: GRPO's policy, old and reference log-probs), per sequence
(`sequence_logps`: a preference pair's rows), per packed document (`document_logps`).

The model's forward gets `ChunkedLogProbs` as its output loss (`ProjectsInChunks`), so
the [B, T, vocab] logits are made a chunk of tokens at a time.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from freetx.data.batch import IGNORE_INDEX, documents_present
from freetx.models.chunked_loss import ChunkedLogProbs


class SequenceLogProbs(NamedTuple):
    """Each row's log-probability of its completion: `sum` [R] of its loss tokens'
    log-probabilities (differentiable where they were), `tokens` [R] how many loss
    tokens (float). Rows come in pairs: 2i the chosen, 2i + 1 the rejected."""

    sum: torch.Tensor
    tokens: torch.Tensor

    def chosen(self) -> SequenceLogProbs:
        """The pairs' chosen rows (0, 2, 4 ...)."""
        return SequenceLogProbs(self.sum[0::2], self.tokens[0::2])

    def rejected(self) -> SequenceLogProbs:
        """The pairs' rejected rows (1, 3, 5 ...)."""
        return SequenceLogProbs(self.sum[1::2], self.tokens[1::2])

    def mean(self) -> torch.Tensor:
        """Each row's mean log-probability per loss token (a row without any: its sum, 0)."""
        return self.sum / self.tokens.clamp(min=1)


def token_logps(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    num_chunks: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    **inputs,
) -> tuple[torch.Tensor, Any]:
    """`model`'s forward with a `ChunkedLogProbs` of `labels` as its output loss: each
    label's log-probability [B, T] float32 (0 where it is `ignore_index`), never the whole
    logits; and what forward returned (an `LMOutput`'s router loss and metrics, for an
    MoE model). `inputs`: the model's others (a packed batch's documents, a context
    shard)."""
    output = model(
        input_ids, output_loss=ChunkedLogProbs(labels, num_chunks, ignore_index), **inputs
    )
    return (output if isinstance(output, torch.Tensor) else output[0]), output


def sequence_logps(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    num_chunks: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    **inputs,
) -> tuple[SequenceLogProbs, Any]:
    """Each row's log-probabilities summed over its loss tokens (`token_logps`), and what
    forward returned. Under context parallelism each rank holds part of each row: the
    caller sums the rows over the cp ranks."""
    per_token, output = token_logps(model, input_ids, labels, num_chunks, ignore_index, **inputs)
    mask = labels != ignore_index
    documents = inputs.get("documents")
    if documents is not None:  # packed pairs: each document is a completion
        return document_logps(per_token, mask, documents, inputs.get("context")), output
    return SequenceLogProbs(per_token.sum(dim=-1), mask.sum(dim=-1).float()), output


def document_logps(
    per_token: torch.Tensor, mask: torch.Tensor, documents: torch.Tensor, context=None
) -> SequenceLogProbs:
    """A packed batch's log-probs by document: rows 2j and 2j + 1 hold a pack's chosen and
    rejected completions as documents 0, 1, ... in the same order, so that document d of
    the two is one pair; the sums come out pair by pair, chosen then rejected, as an
    unpacked batch's rows do. `documents`: whole rows; under context parallelism
    `per_token` and `mask` are this rank's part of each (`context` splits the documents
    alike) and the caller sums over the cp ranks."""
    present = documents_present(documents)  # from the whole rows: the same on every cp rank
    local = documents if context is None else context.split(documents)
    index, inside = local.clamp(min=0), local >= 0
    zeros = per_token.new_zeros(present.shape)
    sums = zeros.scatter_add(1, index, per_token * inside)
    tokens = zeros.scatter_add(1, index, (mask & inside).to(per_token.dtype))
    pairs = present[0::2]

    def paired(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x[0::2][pairs], x[1::2][pairs]], dim=-1).reshape(-1)

    return SequenceLogProbs(paired(sums), paired(tokens))

"""Token losses summed, not averaged: the recipe divides by the global token count.

The output layer's logits are made `num_chunks` chunks of tokens at a time and never
whole (`freetx.models.chunked_loss`: the model hands its last hidden states and its
output layer to the loss).
"""

from __future__ import annotations

import torch

from freetx.data.batch import IGNORE_INDEX, SourcesOf, TokenBatch
from freetx.models.chunked_loss import (
    ChunkedCrossEntropy,
    TokenLosses,
    check_num_chunks,
    forward_with_loss,
    num_chunks_problem,
)
from freetx.models.protocol import LMOutput


class CrossEntropyLoss:
    """Next-token cross-entropy: `(loss summed over tokens, extra per-token sums)`.

    The contract every recipe loss follows: called with the model, its input ids, the
    labels and the model's other inputs, it runs the forward pass and returns the loss
    summed over loss tokens and a dict of further sums (an MoE router's metrics; each
    source's loss) that the recipe divides by the same global token count before
    logging. Summing lets the recipe normalize by the number of loss tokens across all
    micro-batches and ranks, so padded or masked batches count right.

    `num_chunks`: the logits are made that many chunks of tokens at a time, each upcast to
    float32 alone (module docstring); None chooses by the vocabulary size
    (`default_num_chunks`: 8 from 64k tokens, else 1). `sources` (a mixture's batch:
    which source each sample is from, and the sources' names) adds each source's loss
    sum and loss tokens, `loss/<name>` and `loss_tokens/<name>`
    (`freetx.training.meters.per_source_means` makes them means).
    """

    meaningless = staticmethod(num_chunks_problem)  # checked before it is built

    def __init__(self, ignore_index: int = IGNORE_INDEX, num_chunks: int | None = None) -> None:
        self.ignore_index = ignore_index
        self.num_chunks = check_num_chunks(num_chunks)

    def __call__(
        self,
        model,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        sources: SourcesOf | None = None,
        **inputs,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        output, losses, extras = forward_with_loss(
            model, input_ids, labels, self.num_chunks, self.ignore_index, sources, **inputs
        )
        return self.with_router_loss(output, losses, labels, extras)

    def output_loss(
        self, labels: torch.Tensor, sources: SourcesOf | None = None
    ) -> ChunkedCrossEntropy:
        """The output loss a model's forward takes (`output_loss=`), where the caller runs
        the forward itself (a pipeline's last stage), then gives its output to `sums`."""
        per_token = sources is not None
        return ChunkedCrossEntropy(labels, self.num_chunks, self.ignore_index, per_token=per_token)

    def sums(
        self, output, labels: torch.Tensor, sources: SourcesOf | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """What `__call__` returns, from the output of a forward with `output_loss(labels)`."""
        losses = output if isinstance(output, TokenLosses) else output[0]
        mask = labels != self.ignore_index
        extras = {} if sources is None else sources.sums(losses.per_token, mask)
        return self.with_router_loss(output, losses, labels, extras)

    def with_router_loss(self, output, losses: TokenLosses, labels: torch.Tensor, extras: dict):
        """The loss sum (an MoE model's router loss added per loss token) and the extras
        (the router's metrics, per loss token, for the recipe to divide)."""
        tokens = (labels != self.ignore_index).sum()
        return with_router_loss(output, losses.total, extras, tokens)

    def evaluate(self, model, input_ids: torch.Tensor, labels: torch.Tensor, **inputs):
        """The loss on an evaluation batch (models with latents add metrics here);
        `inputs`: the model's others (a packed batch's documents)."""
        return self(model, input_ids, labels, **inputs)


def with_router_loss(
    output, total: torch.Tensor, extras: dict[str, torch.Tensor], units: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A loss summed over `units` (loss tokens, pairs) and its extras, with an MoE model's
    router loss (`LMOutput.aux_loss`) added once per unit and its metrics summed per unit,
    for the recipe to divide by the same count; as they were for any other output."""
    if not isinstance(output, LMOutput):
        return total, extras
    extras.update({name: value.detach() * units for name, value in output.metrics.items()})
    return total + output.aux_loss * units, extras


def loss_tokens(batch: TokenBatch) -> torch.Tensor:
    """How many loss tokens a token batch holds (labels that are not ignored): the unit
    its summed loss is normalized by (`accumulate_gradients(..., count=loss_tokens)`)."""
    return batch.loss_tokens()

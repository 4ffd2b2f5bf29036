"""Token losses summed, not averaged: the recipe divides by the global token count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetx.data.sampling import IGNORE_INDEX
from freetx.models.protocol import LMOutput


class CrossEntropyLoss:
    """Next-token cross-entropy: `(loss summed over tokens, extra per-token sums)`.

    The contract every recipe loss follows: the first value is summed over loss
    tokens; the dict holds further sums (e.g. KL) that the recipe divides by
    the same global token count before logging. Plain CE has none.

    Summing lets the recipe normalize by the number of loss tokens across all
    micro-batches and ranks, so padded or masked batches count right.
    Logits are upcast to float32 (bf16 logits lose precision in the softmax).
    """

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index

    def __call__(
        self, output, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = output[0] if isinstance(output, tuple) else output
        loss_sum = F.cross_entropy(
            logits.float().flatten(0, 1),
            labels.flatten(),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        if not isinstance(output, LMOutput):
            return loss_sum, {}
        tokens = (labels != self.ignore_index).sum()
        extras = {name: value.detach() * tokens for name, value in output.metrics.items()}
        return loss_sum + output.aux_loss * tokens, extras

    def evaluate(self, model, input_ids: torch.Tensor, labels: torch.Tensor, **inputs):
        """The loss on an evaluation batch (models with latents add metrics here);
        `inputs`: the model's others (a packed batch's documents)."""
        return self(model(input_ids, **inputs), labels)


def loss_tokens(batch: dict[str, torch.Tensor], ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """How many loss tokens a token batch holds (labels that are not ignored): the unit
    its summed loss is normalized by (`accumulate_gradients(..., count=loss_tokens)`)."""
    return (batch["labels"] != ignore_index).sum()

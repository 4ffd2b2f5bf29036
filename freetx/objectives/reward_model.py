"""Reward modeling: a sequence scorer (`freetx.models.scorer`) trained on preference pairs
with the Bradley-Terry loss, as TRL's `RewardTrainer` and OpenRLHF's `train_rm`.

With r_c and r_r the scores of a pair's chosen and rejected sequences (the prompt and each
completion, read at the last token that is not padding) and m the pair's margin (0 when
the data gives none), each pair's loss is

    -log sigmoid(r_c - r_r - m)  +  center_rewards_coefficient * (r_c + r_r)^2

the second term (TRL's name; None: none) keeping the rewards near 0. Returned summed over
the pairs, with the metrics' sums (TRL's names: `accuracy`, the share of pairs whose
chosen score is above the rejected's; `margin`, r_c - r_r; `mean_reward`; and, as DPO's
are named, `rewards/chosen`, `rewards/rejected`): the recipe divides both by the global
pair count.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from freetx.fields import field_problems


class BradleyTerryLoss:
    """The reward model's loss over pairs (module docstring)."""

    def __init__(self, center_rewards_coefficient: float | None = None) -> None:
        problems = field_problems(
            BradleyTerryLoss, {"center_rewards_coefficient": center_rewards_coefficient}
        )
        if problems:
            raise ValueError(" ".join(problems))
        self.center_rewards_coefficient = center_rewards_coefficient

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """Values the loss would read as something else, by key: why, and the fix."""
        center = values.get("center_rewards_coefficient")
        if center is not None and not 0 <= center < math.inf:
            return {
                "center_rewards_coefficient": (
                    "it weighs (r_chosen + r_rejected)^2, which keeps the rewards near 0; set "
                    "0 or more (TRL suggests 0.01), or null for none."
                )
            }
        return {}

    def __call__(
        self, scores: torch.Tensor, margin: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(The loss summed over the pairs, the metrics' sums): `scores` [2P], each pair's
        chosen then its rejected (rows 2i, 2i + 1); `margin` [P] or None."""
        chosen, rejected = scores[0::2].float(), scores[1::2].float()
        difference = chosen - rejected
        shifted = difference if margin is None else difference - margin.to(difference)
        losses = -F.logsigmoid(shifted)
        if self.center_rewards_coefficient is not None:
            losses = losses + self.center_rewards_coefficient * (chosen + rejected) ** 2
        metrics = {
            "accuracy": (difference > 0).float(),
            "margin": difference,
            "mean_reward": (chosen + rejected) / 2,
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
        }
        return losses.sum(), {name: value.detach().sum() for name, value in metrics.items()}

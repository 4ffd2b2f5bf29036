"""Reward modeling: a sequence scorer (`freetx.models.scorer`) trained on preference pairs
with the Bradley-Terry loss, as TRL's `RewardTrainer` and OpenRLHF's `train_rm`; and the
trained model's score as a reward (`RewardModel`, for GRPO's rollouts).

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

from freetx.data import PreferenceBatch
from freetx.data.formats import Pair
from freetx.data.preference import encoded_pair
from freetx.errors import ConfigError
from freetx.fields import field_problems
from freetx.models.protocol import ReplacesLanguageHead
from freetx.models.scorer import pooled_scores
from freetx.objectives.held_model import HeldModel


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


class PairMetrics:
    """A reward model's metrics over scored pairs (a validation split, an evaluation):
    `add` each batch's scores, then `means` over every rank: the loss, `accuracy`,
    `margin`, `mean_reward`, `rewards/chosen`, `rewards/rejected` per pair, and
    `std_reward`, `min_reward`, `max_reward` over every scored sequence."""

    def __init__(self, loss_fn: BradleyTerryLoss) -> None:
        self.loss_fn, self.sums = loss_fn, {}
        self.extremes = {"max_reward": -math.inf, "min_reward": -math.inf}  # min: of -scores

    def add(self, scores: torch.Tensor, batch: PreferenceBatch) -> None:
        """One batch's scores [2P] of its P pairs (chosen, rejected, ...); an evaluation
        shard's repeats left out."""
        real = batch.real_pairs().to(scores.device)
        scores, margins = scores[real.repeat_interleave(2)], batch.pair_margins()
        loss, parts = self.loss_fn(
            scores, None if margins is None else margins[real.to(margins.device)]
        )
        kept = scores.double()
        parts |= {
            "loss": loss,
            "pairs": torch.tensor(scores.numel() / 2),
            "reward_sq": (kept**2).sum(),
        }
        for name, value in parts.items():
            self.sums[name] = self.sums.get(name, 0) + value
        if kept.numel():
            self.extremes["max_reward"] = max(self.extremes["max_reward"], float(kept.max()))
            self.extremes["min_reward"] = max(self.extremes["min_reward"], float(-kept.min()))

    def means(self, groups, over: str = "dp") -> dict[str, float]:
        """The metrics over every rank's pairs (one collective; every rank calls it)."""
        totals, extremes = groups.sum_and_max(self.sums, self.extremes, over=over)
        pairs = max(float(totals.pop("pairs")), 1.0)
        means = {name: float(value) / pairs for name, value in totals.items()}
        square = means.pop("reward_sq") / 2  # over both rows of every pair
        means["std_reward"] = max(square - means["mean_reward"] ** 2, 0.0) ** 0.5
        return means | {"max_reward": extremes["max_reward"], "min_reward": -extremes["min_reward"]}


class RewardModel(HeldModel):
    """A trained reward model's score as a reward (TRL's `reward_funcs` given a reward
    model):

        rewards:
          - _component_: freetx.objectives.RewardModel
            path: runs/llm_rm_tiny     # rm_fsdp2's run, or an HF XForSequenceClassification folder
            tokenizer: bytes           # the reward model's tokenizer folder (default: path)

    Each completion is read with its prompt as rm_fsdp2 trained the model to read a pair's
    row (`freetx.data.preference.encoded_pair`: the prompt's tokens, then the completion's
    with its end token, rendered with the tokenizer's chat template where it has one; a
    conversation's prompt and a string completion become its messages and the assistant's
    reply), cut to the model's positions as a training row is cut (the prompt's start, then
    the completion's end), and scored at its last token that is not padding, in batches of
    `batch_size`.
    Placed and gathered like a judge (`HeldModel`: sharded like a reference under a sharded
    policy). TRL's batched form: its call sees the rank's completions of a step at once."""

    what = "the reward model"

    def __init__(self, path: str, tokenizer: str | None = None, batch_size: int = 16) -> None:
        super().__init__(path, tokenizer)
        self.batch_size = batch_size

    def check(self, model: torch.nn.Module) -> None:
        """Refuse a model that is no reward model (a sequence scorer)."""
        if not isinstance(model, ReplacesLanguageHead):
            raise ConfigError(
                f"{self.path} holds a {type(model).__name__}, which gives no score per "
                "sequence: a reward model is a sequence scorer.",
                fix="Point path at rm_fsdp2's run or an HF XForSequenceClassification folder "
                "(num_labels 1); a language model's verdict is freetx.objectives.Judge's.",
            )

    def tokens(self, prompt, completion) -> list[int]:
        """The token ids a completion is scored on, with its prompt (class docstring)."""
        chat = getattr(self.tokenizer, "chat_template", None) is not None
        if isinstance(prompt, list) and not chat:  # the user's last words, as a string
            prompt = next(m["content"] for m in reversed(prompt) if m["role"] == "user")
        if isinstance(prompt, list) and isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        elif isinstance(completion, list) and not isinstance(prompt, list):
            prompt = [{"role": "user", "content": prompt}]
        encoded = encoded_pair(self.tokenizer, Pair(prompt, completion, completion))
        prompt_ids, completion_ids = encoded[0][0], encoded[1][0]
        # cut to the model's positions as a pair's row is cut: the prompt's start first,
        # down to half of them, then the completion's end
        limit = self.model.config.max_seq_len if self.model is not None else None
        if limit is not None and len(prompt_ids) + len(completion_ids) > limit:
            kept = max(limit - len(completion_ids), min(len(prompt_ids), limit // 2))
            prompt_ids = prompt_ids[len(prompt_ids) - min(kept, len(prompt_ids)) :]
            completion_ids = completion_ids[: limit - len(prompt_ids)]
        return [*prompt_ids, *completion_ids]

    @torch.no_grad()
    def __call__(self, prompts, completions, completion_ids, **columns) -> list[float]:
        inputs = [self.tokens(p, c) for p, c in zip(prompts, completions)]
        return self.scored(inputs, self.batch_size, self._scores)

    def _scores(self, inputs: list[list[int]]) -> list[float]:
        """Each input's score: the batch right-padded with the model's pad id (one input at
        a time for a model without one, as transformers reads it)."""
        pad = self.model.config.pad_token_id
        if pad is None and len(inputs) > 1:
            return [score for ids in inputs for score in self._scores([ids])]
        device = next(self.model.parameters()).device
        width = max(len(ids) for ids in inputs)
        ids = torch.tensor([x + [pad or 0] * (width - len(x)) for x in inputs], device=device)
        return pooled_scores(self.model(ids), ids, pad).float().tolist()

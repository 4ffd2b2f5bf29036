"""KTO (Ethayarajh et al. 2024): preference optimization from unpaired examples, each a
prompt, a completion and a label (desirable or not), against a reference model.

An unpaired batch (`freetx.data.UnpairedPreferenceDataset`, `collate_pairs`) interleaves
each example (row 2i) with its KL row (row 2i + 1: its prompt and another example's
completion). With r = log pi(y|x) - log pi_ref(y|x) on an example's completion (summed
token log-probabilities) and z the KL baseline, the mean over the global batch's KL rows
of log pi(y'|x) - log pi_ref(y'|x), clamped at 0 and not differentiated (`KTOBaseline`),
each example's loss is

    desirable:    desirable_weight   * (1 - sigmoid(beta * (r - z)))
    undesirable:  undesirable_weight * (1 - sigmoid(beta * (z - r)))

as TRL's `KTOTrainer` (loss_type "kto"). TRL takes z over each micro-batch gathered from
every process; here it is the optimizer step's whole global batch over every rank, which
is the same with one micro-batch per step and makes the loss the same at any world size
and micro-batch split.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from freetx.fields import field_problems
from freetx.models.chunked_loss import num_chunks_problem
from freetx.objectives.logprobs import SequenceLogProbs


class KTOBaseline(NamedTuple):
    """What KTO's loss reads from the whole global batch: `kl`, the baseline z (clamped at
    0), and the counts of its examples, desirable and undesirable (the metrics' means)."""

    kl: float
    examples: float
    desirable: float

    @classmethod
    def of(cls, totals: dict[str, Any]) -> KTOBaseline:
        """From the global sums of `kl_sums`' keys over every micro-batch and rank."""
        examples = float(totals["examples"])
        kl = max(float(totals["kl"]) / max(examples, 1.0), 0.0)
        return cls(kl, examples, float(totals["desirable"]))

    @property
    def undesirable(self) -> float:
        return self.examples - self.desirable


def kl_sums(
    policy: SequenceLogProbs, reference: SequenceLogProbs, desirable: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A micro-batch's part of `KTOBaseline`: its KL rows' log pi - log pi_ref summed, its
    examples and its desirable ones (`desirable` [examples] bools), to sum over ranks."""
    return {
        "kl": (policy.sum - reference.sum).double().sum(),
        "examples": torch.tensor(float(desirable.numel()), dtype=torch.float64),
        "desirable": desirable.double().sum().cpu(),
    }


class KTOLoss:
    """KTO's loss summed over a batch's examples, and TRL's metrics' sums (module
    docstring). `beta` scales the log-ratio; `desirable_weight` and `undesirable_weight`
    weigh each kind (TRL: keep desirable_weight * desirable examples /
    (undesirable_weight * undesirable examples) within [1, 4/3]). The metrics, summed so
    that the recipe's division by the global batch's examples gives TRL's means over each
    kind: `rewards/chosen` (beta r over the desirable examples), `rewards/rejected` (over
    the undesirable ones), `rewards/margins` (their difference), `logps/chosen`,
    `logps/rejected` (the policy's summed log-probs). `num_chunks`: the logits a chunk of
    tokens at a time (`ChunkedLogProbs`; None: by the vocabulary size)."""

    def __init__(
        self,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        num_chunks: int | None = None,
    ) -> None:
        values = dict(
            beta=beta,
            desirable_weight=desirable_weight,
            undesirable_weight=undesirable_weight,
            num_chunks=num_chunks,
        )
        problems = field_problems(KTOLoss, values)
        if problems:
            raise ValueError(" ".join(problems))
        self.beta, self.num_chunks = beta, num_chunks
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """Values the loss would read as something else, by key: why, and the fix."""
        found = num_chunks_problem(values)
        if not 0 < values.get("beta", 0.1) < math.inf:
            found["beta"] = "beta scales the log-ratios; set a finite positive one (0.1)."
        weights = [values.get(k, 1.0) for k in ("desirable_weight", "undesirable_weight")]
        for key, weight in zip(("desirable_weight", "undesirable_weight"), weights):
            if not 0 <= weight < math.inf:
                kind = key.split("_")[0]
                found[key] = f"it weighs the {kind} examples' losses; set 0 or more (1.0)."
        if not found and not any(weights):
            found["desirable_weight"] = (
                "with undesirable_weight 0 too, no example weighs anything; set either above 0."
            )
        return found

    @property
    def needs_reference(self) -> bool:
        """KTO compares with a reference model (its log-ratios)."""
        return True

    def __call__(
        self,
        policy: SequenceLogProbs,
        reference: SequenceLogProbs,
        desirable: torch.Tensor,
        baseline: KTOBaseline,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(The loss summed over the examples, the metrics' sums): `policy` and `reference`
        hold each example's summed log-probs (its completion row), `desirable` [examples]
        its label, `baseline` the global batch's (`KTOBaseline`)."""
        desirable = desirable.to(policy.sum.device).bool()
        ratio = policy.sum - reference.sum
        losses = torch.where(
            desirable,
            self.desirable_weight * (1 - torch.sigmoid(self.beta * (ratio - baseline.kl))),
            self.undesirable_weight * (1 - torch.sigmoid(self.beta * (baseline.kl - ratio))),
        )
        rewards = self.beta * ratio.detach()
        # a kind's sum times examples / (its count): / examples gives its mean (0 without any)
        chosen = baseline.examples / max(baseline.desirable, 1.0)
        rejected = baseline.examples / max(baseline.undesirable, 1.0)
        logps = policy.sum.detach()
        metrics = {
            "rewards/chosen": rewards[desirable].sum() * chosen,
            "rewards/rejected": rewards[~desirable].sum() * rejected,
            "logps/chosen": logps[desirable].sum() * chosen,
            "logps/rejected": logps[~desirable].sum() * rejected,
        }
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return losses.sum(), metrics

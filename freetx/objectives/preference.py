"""Preference losses over pairs of sequences: DPO and its kin, summed over pairs.

A preference batch interleaves its pairs: row 2i is pair i's chosen completion, row
2i + 1 its rejected one, so that both are in one forward. `sequence_logps` runs a
model's forward with `ChunkedLogProbs` as its output loss (the [B, T, vocab] logits
never whole) and sums each row's log-probabilities over its loss tokens (the
completion's); `PreferenceLoss` turns the policy's sums, and the reference model's
where its type has one, into the loss summed over the pairs and the metrics TRL logs
(`rewards/chosen`, `rewards/accuracies` ...), summed too: the recipe divides both by the
global pair count, as `CrossEntropyLoss` sums over tokens.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

import torch
import torch.nn.functional as F

from freetx.fields import field_problems
from freetx.models.chunked_loss import num_chunks_problem
from freetx.objectives.logprobs import SequenceLogProbs

# type -> (its paper, whether it compares with a reference model)
PREFERENCE_TYPES = {
    "sigmoid": ("DPO, Rafailov et al. 2023", True),
    "robust": ("robust DPO, Chowdhury et al. 2024", True),
    "ipo": ("IPO, Azar et al. 2023", True),
    "hinge": ("SLiC, Zhao et al. 2023", True),
    "simpo": ("SimPO, Meng et al. 2024", False),
    "orpo": ("ORPO, Hong et al. 2024", False),
}
SMOOTHED = ("sigmoid", "robust")
# the papers' names for the types, as users write them: the did-you-mean of `meaningless`
PAPER_NAMES = {
    "dpo": "sigmoid",
    "cdpo": "sigmoid",
    "rdpo": "robust",
    "slic": "hinge",
}  # the types that read label_smoothing


def _log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stably (Mächler 2012): log(-expm1(x)) near 0,
    log1p(-exp(x)) below -ln 2; x is kept below -tiny, where 1 - exp(x) would be 0."""
    x = x.clamp(max=-torch.finfo(x.dtype).tiny)
    near = x > -math.log(2)
    return torch.where(
        near,
        torch.log(-torch.expm1(x.clamp(min=-math.log(2)))),
        torch.log1p(-torch.exp(x.clamp(max=-math.log(2)))),
    )


class PreferenceLoss:
    """A preference loss over pairs (`loss.type`), with `beta`; returned summed over the
    batch's pairs, with the metrics' sums. With h the policy's log-probability margin
    over the reference's, on the completions' summed token log-probabilities,
    h = (pi_c - ref_c) - (pi_r - ref_r), and sigma the logistic function, each pair's:

        sigmoid  DPO (Rafailov et al. 2023): -log sigma(beta h); with label_smoothing eps,
                 conservative DPO (cDPO): -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)
        robust   robust DPO (Chowdhury et al. 2024), unbiased under a fraction eps of
                 flipped labels: (-(1 - eps) log sigma(beta h) + eps log sigma(-beta h))
                 / (1 - 2 eps)
        ipo      IPO (Azar et al. 2023): (h - 1 / (2 beta))^2, with h on the completions'
                 MEAN token log-probabilities (as TRL computes it; the paper's are sums)
        hinge    SLiC (Zhao et al. 2023): relu(1 - beta h)
        simpo    SimPO (Meng et al. 2024), no reference: -log sigma(beta m_c - beta m_r -
                 gamma), m the completion's mean token log-probability
        orpo     ORPO (Hong et al. 2024), no reference: -m_c - beta log sigma(log odds_c -
                 log odds_r), log odds = m - log(1 - exp(m)): the chosen's NLL per token
                 plus the odds ratio's term, beta being the paper's lambda

    `rpo_alpha` (RPO, Pang et al. 2024, as TRL adds it): plus rpo_alpha times the chosen's
    NLL per token (-m_c), for every type but orpo (which has it already).

    The metrics, summed over pairs, detached (TRL's names): `rewards/chosen` and
    `rewards/rejected`, beta (pi - ref) on the log-probabilities the loss compares (sums;
    means for ipo), or beta m for simpo and orpo; `rewards/accuracies` (chosen's reward
    above the rejected's), `rewards/margins` (their difference); `logps/chosen` and
    `logps/rejected`, the policy's summed log-probabilities; `nll_loss` (orpo,
    rpo_alpha), and orpo's `log_odds_ratio` (log sigma of the log odds' difference)
    and `log_odds_chosen` (that difference). `num_chunks`: the logits a chunk of tokens
    at a time (`ChunkedLogProbs`; None: by the vocabulary size).
    """

    def __init__(
        self,
        type: str = "sigmoid",
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        gamma: float = 0.5,
        rpo_alpha: float | None = None,
        num_chunks: int | None = None,
    ) -> None:
        values = dict(
            type=type,
            beta=beta,
            label_smoothing=label_smoothing,
            gamma=gamma,
            rpo_alpha=rpo_alpha,
            num_chunks=num_chunks,
        )
        problems = field_problems(PreferenceLoss, values)
        if problems:
            raise ValueError(" ".join(problems))
        self.type, self.beta, self.label_smoothing = type, beta, label_smoothing
        self.gamma, self.rpo_alpha, self.num_chunks = gamma, rpo_alpha, num_chunks

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """Values the loss would read as something else, by key: why, and the fix
        (`freetx validate` and every run check a config's `loss:` node with it)."""
        found = num_chunks_problem(values)
        kind = values.get("type", "sigmoid")
        if kind not in PREFERENCE_TYPES:
            close = [PAPER_NAMES[str(kind).lower()]] if str(kind).lower() in PAPER_NAMES else []
            close = close or difflib.get_close_matches(str(kind), PREFERENCE_TYPES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            known = ", ".join(f"{name} ({paper})" for name, (paper, _) in PREFERENCE_TYPES.items())
            found["type"] = f"there is no such preference loss{hint}; set one of: {known}."
        beta = values.get("beta", 0.1)
        if not 0 < beta < math.inf:
            found["beta"] = (
                "beta scales the log-probability margins; set a finite positive one (0.1)."
            )
        gamma = values.get("gamma", 0.5)
        if not 0 <= gamma < math.inf:
            found["gamma"] = (
                "it is SimPO's target reward margin, by which the chosen completion's reward "
                "should exceed the rejected one's; a negative margin lets the rejected one "
                "win by that much at little loss. Set a finite 0 or more (the paper's 0.5 to "
                "1.5)."
            )
        smoothing = values.get("label_smoothing", 0.0)
        if not 0 <= smoothing < 0.5:
            found["label_smoothing"] = (
                "it is the fraction of pairs taken as flipped, below one half; set 0 or more "
                "and below 0.5 (e.g. 0.1), or 0 for none."
            )
        elif smoothing and kind in PREFERENCE_TYPES and kind not in SMOOTHED:
            found["label_smoothing"] = (
                f"the {kind} loss has no label smoothing (only sigmoid and robust have); set "
                "0, or loss.type=robust."
            )
        alpha = values.get("rpo_alpha")
        if alpha is not None and not alpha >= 0:
            found["rpo_alpha"] = (
                "it weighs the chosen completion's NLL added to the loss; set 0 or more (e.g. "
                "1.0), or null for none."
            )
        elif alpha is not None and kind == "orpo":
            found["rpo_alpha"] = (
                "orpo's loss has the chosen completion's NLL already; set rpo_alpha=null, or "
                "another loss.type."
            )
        return found

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with a reference model (not simpo, not orpo)."""
        return self.type_needs_reference(self.type)

    @staticmethod
    def type_needs_reference(kind: str) -> bool:
        """Whether `loss.type` `kind` compares with a reference model (an unknown type is
        `meaningless`'s to refuse: as DPO here)."""
        return PREFERENCE_TYPES.get(kind, ("", True))[1]

    def __call__(
        self, policy: SequenceLogProbs, reference: SequenceLogProbs | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(The loss summed over the pairs, the metrics' sums over the pairs): `policy`
        and `reference` hold each row's log-probabilities, chosen and rejected rows
        interleaved."""
        if self.needs_reference and reference is None:
            raise ValueError(f"the {self.type} loss compares with a reference: pass its log-probs")
        chosen, rejected = policy.chosen(), policy.rejected()
        metrics: dict[str, torch.Tensor] = {}
        if self.needs_reference:
            ref_chosen, ref_rejected = reference.chosen(), reference.rejected()
            if self.type == "ipo":
                ratio_c = chosen.mean() - ref_chosen.mean()
                ratio_r = rejected.mean() - ref_rejected.mean()
            else:
                ratio_c, ratio_r = chosen.sum - ref_chosen.sum, rejected.sum - ref_rejected.sum
            losses = self.reference_losses(ratio_c - ratio_r)
            reward_c, reward_r = self.beta * ratio_c, self.beta * ratio_r
        elif self.type == "simpo":
            reward_c, reward_r = self.beta * chosen.mean(), self.beta * rejected.mean()
            losses = -F.logsigmoid(reward_c - reward_r - self.gamma)
        else:  # orpo
            mean_c, mean_r = chosen.mean(), rejected.mean()
            log_odds = (mean_c - _log1m_exp(mean_c)) - (mean_r - _log1m_exp(mean_r))
            ratio = F.logsigmoid(log_odds)
            losses = -mean_c - self.beta * ratio
            reward_c, reward_r = self.beta * mean_c, self.beta * mean_r
            metrics |= {"nll_loss": -mean_c, "log_odds_ratio": ratio, "log_odds_chosen": log_odds}
        if self.rpo_alpha is not None:
            nll = -chosen.mean()
            losses = losses + self.rpo_alpha * nll
            metrics["nll_loss"] = nll
        metrics |= {
            "rewards/chosen": reward_c,
            "rewards/rejected": reward_r,
            "rewards/accuracies": (reward_c > reward_r).float(),
            "rewards/margins": reward_c - reward_r,
            "logps/chosen": chosen.sum,
            "logps/rejected": rejected.sum,
        }
        return losses.sum(), {name: value.detach().sum() for name, value in metrics.items()}

    def reference_losses(self, margin: torch.Tensor) -> torch.Tensor:
        """Each pair's loss of a type with a reference, from h, its margin (class docstring)."""
        logits, eps = self.beta * margin, self.label_smoothing
        if self.type == "sigmoid":
            return -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
        if self.type == "robust":
            return (-(1 - eps) * F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1 - 2 * eps)
        if self.type == "ipo":
            return (margin - 1 / (2 * self.beta)) ** 2
        return F.relu(1 - logits)  # hinge

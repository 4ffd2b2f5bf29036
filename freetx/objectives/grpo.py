"""The objective of online RL with verifiable rewards: GRPO and its kin (DAPO, Dr. GRPO,
GSPO), summed over a micro-batch, and the group-relative advantages it weighs tokens by.

A prompt's `group_size` completions are adjacent rows (g * G ... g * G + G - 1);
`group_advantages` compares each completion's reward with its group's. `GRPOLoss` takes
each completion token's log-probability under the policy (and under the policy that
generated it, and under the reference model where `beta` > 0) and returns the loss
summed over its micro-batch's units, with the metrics' sums over the same units (TRL's
names: `kl`, `clip_ratio/low_mean` ...): the recipe divides both by the units of all
micro-batches on all ranks (`units`), as `CrossEntropyLoss` sums over tokens, so that a
micro-batch split gives the whole batch's mean.
"""

from __future__ import annotations

import difflib
from typing import Any

import torch

from freetx.fields import field_problems
from freetx.models.chunked_loss import num_chunks_problem

STD_EPS = 1e-4  # added to a std before dividing by it, as TRL

# each knob's values -> the paper (or what it is); the did-you-mean of `meaningless` reads
# the papers' and TRL's names for them (ALIASES) first
AGGREGATIONS = {
    "token": "DAPO, Yu et al. 2025: over every completion token of the batch",
    "sequence": "GRPO, Shao et al. 2024: each completion's token mean, then over completions",
    "fixed": "Dr. GRPO, Liu et al. 2025: each completion's token sum / max_completion_length",
}
IMPORTANCE_SAMPLING = {
    "token": "a ratio per token, as PPO and GRPO",
    "sequence": "GSPO, Zheng et al. 2025: one ratio per completion",
}
SCALES = {
    "group": "GRPO: divided by the group's std",
    "batch": "divided by the std of the batch's rewards",
    "none": "Dr. GRPO: not divided",
}
ALIASES = {
    "aggregation": {"dapo": "token", "bnpo": "token", "grpo": "sequence", "dr_grpo": "fixed"},
    "importance_sampling": {"gspo": "sequence", "grpo": "token", "ppo": "token"},
    "scale_rewards": {"true": "group", "false": "none", "dr_grpo": "none", "std": "group"},
}


def _name_problem(key: str, value: Any, known: dict[str, str]) -> str:
    """Why `value` of a knob whose values are `known`'s keys means nothing, with the
    closest known value (a paper's or TRL's name first) and the fix; "" when it is known."""
    if isinstance(value, str) and value in known:
        return ""
    name = str(value).lower()
    close = [ALIASES[key][name]] if name in ALIASES[key] else []
    close = close or difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    values = "; ".join(f"{value} ({what})" for value, what in known.items())
    return f"there is no such {key}{hint}; set one of: {values}."


class GRPOLoss:
    """The clipped policy-ratio objective of online RL, with a KL term to the reference.
    With A the completion's advantage (`group_advantages`), rho the ratio of the policy's
    probability of a token to the policy's that generated it (pi / pi_old), each
    completion token's loss:

        -min(rho A, clip(rho, 1 - epsilon_low, 1 + epsilon_high) A) + beta k3,
        k3 = exp(q) - q - 1, q = log pi_ref - log pi  (the KL's k3 estimator)

    `epsilon_high` above `epsilon_low` is DAPO's clip-higher (0.2, 0.28); None: the same.
    `beta` 0 (DAPO's and Dr. GRPO's default): no KL term and no reference model.

    `importance_sampling`: "token", rho per token; "sequence" (GSPO, Zheng et al. 2025),
    one rho per completion, exp of the mean over its tokens of (log pi - log pi_old),
    clipped per completion and the same for each of its tokens, differentiated through
    that mean (GSPO's gradient; TRL's importance_sampling_level="sequence").

    `aggregation`, how token losses make the loss: "token" (DAPO, Yu et al. 2025) their
    sum over every completion token of the global batch / those tokens' count;
    "sequence" (GRPO, Shao et al. 2024) each completion's token mean, then the mean over
    completions; "fixed" (Dr. GRPO, Liu et al. 2025) each completion's token sum /
    max_completion_length, then the mean over completions. The call returns the sum over
    its micro-batch's units (`units`: tokens, or completions), so that summing over
    micro-batches and ranks and dividing by the summed units gives those means exactly.

    The metrics, summed over the same units, detached (TRL's names): `kl`, k3's mean
    (beta > 0 only); `clip_ratio/low_mean`, the share of tokens whose rho is below 1 -
    epsilon_low with A < 0 (their gradient clipped away), `clip_ratio/high_mean` above 1
    + epsilon_high with A > 0, `clip_ratio/region_mean` either. A unit being a
    completion, each completion adds its tokens' mean.

    `scale_rewards` is `group_advantages`'s `scale`, kept here for the recipe (one
    `loss:` node holds the objective); `num_chunks`: the logits a chunk of tokens at a
    time (`ChunkedLogProbs`; None: by the vocabulary size).
    """

    def __init__(
        self,
        epsilon_low: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        aggregation: str = "token",
        importance_sampling: str = "token",
        scale_rewards: str = "group",
        num_chunks: int | None = None,
    ) -> None:
        values = dict(
            epsilon_low=epsilon_low,
            epsilon_high=epsilon_high,
            beta=beta,
            aggregation=aggregation,
            importance_sampling=importance_sampling,
            scale_rewards=scale_rewards,
            num_chunks=num_chunks,
        )
        problems = field_problems(GRPOLoss, values)
        if problems:
            raise ValueError(" ".join(problems))
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
        self.beta, self.aggregation = beta, aggregation
        self.importance_sampling, self.scale_rewards = importance_sampling, scale_rewards
        self.num_chunks = num_chunks

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """Values the loss would read as something else, by key: why, and the fix
        (`freetx validate` and every run check a config's `loss:` node with it)."""
        found = num_chunks_problem(values)
        low = values.get("epsilon_low", 0.2)
        if not 0 <= low < 1:
            found["epsilon_low"] = (
                "the ratio is clipped below at 1 - epsilon_low, which must be above 0; set 0 "
                "or more and below 1 (0.2)."
            )
        high = values.get("epsilon_high")
        if high is not None and not high >= 0:
            found["epsilon_high"] = (
                "the ratio is clipped above at 1 + epsilon_high; set 0 or more (DAPO's "
                "clip-higher: 0.28), or null for epsilon_low's."
            )
        beta = values.get("beta", 0.0)
        if not beta >= 0:
            found["beta"] = (
                "it weighs the KL to the reference model added to the loss; set 0 or more "
                "(0.04 as GRPO, 0 for no KL term and no reference model)."
            )
        for key, known, default in (
            ("aggregation", AGGREGATIONS, "token"),
            ("importance_sampling", IMPORTANCE_SAMPLING, "token"),
            ("scale_rewards", SCALES, "group"),
        ):
            problem = _name_problem(key, values.get(key, default), known)
            if problem:
                found[key] = problem
        return found

    @property
    def needs_reference(self) -> bool:
        """Whether the loss has a KL term to a reference model (beta > 0)."""
        return self.beta > 0

    def units(self, mask: torch.Tensor) -> torch.Tensor:
        """What the summed loss and metrics are divided by, counted over a micro-batch
        (the recipe sums it over all micro-batches and ranks): its completion tokens
        (aggregation "token"), else its completions (rows of `mask`)."""
        if self.aggregation == "token":
            return mask.sum()
        return torch.tensor(mask.shape[0], device=mask.device)

    def __call__(
        self,
        logps: torch.Tensor,
        old_logps: torch.Tensor | None,
        ref_logps: torch.Tensor | None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        max_completion_length: int | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(The loss summed over the micro-batch's units, the metrics' sums over them).
        `logps` [R, T]: each completion token's log-probability under the policy
        (differentiable); `old_logps` [R, T] under the policy that generated them, None
        when it is this one (one optimizer step per generation: rho = 1, the plain policy
        gradient); `ref_logps` [R, T] under the reference model (read when beta > 0);
        `advantages` [R]; `mask` [R, T], the completion tokens: what the tensors hold
        elsewhere reaches neither the loss nor the gradients; `advantages` [R, T] (a
        per-token estimate: `ReinforcePlusPlus`) weighs each token by its own.
        `max_completion_length`:
        the constant of aggregation "fixed"."""
        if self.needs_reference and ref_logps is None:
            raise ValueError(
                f"beta={self.beta} adds the KL to the reference model: pass its log-probs "
                "(ref_logps), or set loss.beta=0 for no KL term."
            )
        if self.aggregation == "fixed" and max_completion_length is None:
            raise ValueError(
                "aggregation 'fixed' divides each completion's token sum by the completion "
                "length limit: pass max_completion_length."
            )
        if advantages.shape not in (logps.shape[:1], logps.shape) or mask.shape != logps.shape:
            raise ValueError(
                f"logps {tuple(logps.shape)}, mask {tuple(mask.shape)} and advantages "
                f"{tuple(advantages.shape)} do not match: pass [R, T], [R, T] and [R] (or "
                "[R, T]: one per token)."
            )
        mask = mask.bool()
        old = logps.detach() if old_logps is None else old_logps
        log_ratio = torch.where(mask, logps - old, 0.0)  # 0 off the completions: exp finite
        tokens = mask.sum(dim=-1)
        if self.importance_sampling == "sequence":
            log_ratio = (log_ratio.sum(dim=-1) / tokens.clamp(min=1))[:, None]
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1 - self.epsilon_low, 1 + self.epsilon_high)
        adv = advantages.to(ratio.dtype)
        adv = adv[:, None] if adv.ndim == 1 else torch.where(mask, adv, 0.0)
        per_token = -torch.minimum(ratio * adv, clipped * adv).expand(mask.shape)
        metrics: dict[str, torch.Tensor] = {}
        if self.needs_reference:
            q = torch.where(mask, ref_logps - logps, 0.0)
            kl = torch.exp(q) - q - 1
            per_token = per_token + self.beta * kl
            metrics["kl"] = kl
        low = (ratio < 1 - self.epsilon_low) & (adv < 0)
        high = (ratio > 1 + self.epsilon_high) & (adv > 0)
        metrics["clip_ratio/low_mean"] = low.expand(mask.shape).float()
        metrics["clip_ratio/high_mean"] = high.expand(mask.shape).float()
        metrics["clip_ratio/region_mean"] = (low | high).expand(mask.shape).float()
        if self.aggregation == "fixed":
            loss = torch.where(mask, per_token, 0.0).sum() / max_completion_length
        else:
            loss = self._unit_sum(per_token, mask, tokens)
        return loss, {name: self._unit_sum(v.detach(), mask, tokens) for name, v in metrics.items()}

    def _unit_sum(self, per_token: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor):
        """A per-token value's sum over the units: over the completion tokens (aggregation
        "token"), else over the completions of each one's token mean (0 without tokens)."""
        per_token = torch.where(mask, per_token, 0.0)
        if self.aggregation == "token":
            return per_token.sum()
        return (per_token.sum(dim=-1) / tokens.clamp(min=1)).sum()

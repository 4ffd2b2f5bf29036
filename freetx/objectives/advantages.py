"""Advantage estimates: how much better than its alternatives each completion of a
rollout did, the weight the policy-gradient loss gives its tokens.

Two kinds, named by a GRPO config's `advantage:`:

- a `Baseline`, one advantage per completion: its reward minus the baseline (`GroupMean`,
  GRPO's; `LeaveOneOut`, RLOO's), divided by a std as `loss.scale_rewards` says (its
  group's, the batch's, or none); `group_advantages`. A new one is a class with a
  `__call__(grouped) -> baseline`.
- a `TokenAdvantages`, one advantage per token (`ReinforcePlusPlus`: a KL to the
  reference folded into the reward token by token, each token's return normalized over
  every token of the rollout on every rank).

A prompt's `group_size` completions are adjacent rows (g * G ... g * G + G - 1).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from freetx.data import RolloutBatch
from freetx.distributed import ParallelGroups
from freetx.objectives.grpo import SCALES, STD_EPS, _name_problem

KL_ESTIMATORS = {
    "k1": "log pi - log pi_ref (OpenRLHF's default)",
    "k2": "(log pi - log pi_ref)^2 / 2",
    "k3": "exp(q) - q - 1, q = log pi_ref - log pi (GRPO's)",
}
TOKEN_BASELINES = {
    "none": "REINFORCE++: the reward itself",
    "group": "REINFORCE++-baseline: the reward minus its group's mean",
}


class Baseline(Protocol):
    """What each completion's reward is compared with: [groups, group_size] rewards ->
    a baseline of the same shape (or [groups, 1])."""

    def __call__(self, grouped: torch.Tensor) -> torch.Tensor: ...


class GroupMean:
    """GRPO's baseline (Shao et al. 2024): the mean reward of the completion's group."""

    def __call__(self, grouped: torch.Tensor) -> torch.Tensor:
        return grouped.mean(dim=1, keepdim=True)


class LeaveOneOut:
    """RLOO's baseline (Ahmadian et al. 2024): the mean reward of the group's other
    completions, so that a completion is not compared with itself."""

    def __call__(self, grouped: torch.Tensor) -> torch.Tensor:
        return (grouped.sum(dim=1, keepdim=True) - grouped) / (grouped.shape[1] - 1)


class GroupAdvantages(NamedTuple):
    """What `group_advantages` returns: `advantages` [R] float32, one per completion (the
    same for each of its tokens); `zero_variance` [R // group_size] bool, the groups whose
    rewards are all equal (they carry no signal: their advantages are exactly 0)."""

    advantages: torch.Tensor
    zero_variance: torch.Tensor


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale: str = "group",
    baseline: Baseline | None = None,
    batch_std: float | None = None,
) -> GroupAdvantages:
    """Each completion's advantage, its reward minus its `baseline` (by default its group's
    mean: A_i = r_i - mean(group)), divided by (std + 1e-4) as `scale` says: "group" the
    group's std (GRPO), "batch" the std of every rank's rewards (`batch_std`; else the std
    of these R rewards), "none" not divided (Dr. GRPO). Stds are unbiased (TRL's
    `torch.std`). `rewards` [R], R = groups * group_size, a group's completions adjacent.
    A group whose rewards are all equal gets advantages of exactly 0 (its float mean
    can differ from them by a rounding, which 1e-4 would not hide)."""
    problem = _name_problem("scale_rewards", scale, SCALES)
    if problem:
        raise ValueError(f"scale={scale!r}: {problem}")
    if group_size < 2:
        raise ValueError(
            f"group_size={group_size}: a completion alone has no group to be compared with; "
            "generate 2 or more per prompt (num_generations)."
        )
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} are not groups of {group_size}: pass one "
            "reward per completion, [groups * group_size], each group's rows adjacent."
        )
    rewards = rewards.float()
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"the rewards of rows {bad[:8]} are not finite ({rewards[bad[:8]].tolist()}): "
            "a reward function returned nan or inf; make it return a number for every row."
        )
    grouped = rewards.view(-1, group_size)
    zero_variance = (grouped == grouped[:, :1]).all(dim=1)
    advantages = grouped - (baseline or GroupMean())(grouped)
    if scale == "group":
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + STD_EPS)
    elif scale == "batch":
        advantages = advantages / ((rewards.std() if batch_std is None else batch_std) + STD_EPS)
    advantages = torch.where(zero_variance[:, None], 0.0, advantages)
    return GroupAdvantages(advantages.reshape(-1), zero_variance)


@runtime_checkable
class TokenAdvantages(Protocol):
    """An estimate whose advantages differ from token to token: each completion's centered
    reward (`centered`) becomes a return per token (`returns`, which may read the policy's
    and the reference's log-probs at generation time), and the returns of every token of
    the rollout, over every rank, are normalized together (`token_advantages`)."""

    @property
    def needs_reference(self) -> bool: ...

    def centered(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor: ...

    def returns(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        logps: torch.Tensor | None,
        ref_logps: torch.Tensor | None,
    ) -> torch.Tensor: ...


class ReinforcePlusPlus:
    """REINFORCE++ (Hu 2025; OpenRLHF's `advantage_estimator: reinforce`, and with
    `baseline: group` its `reinforce_baseline`): with r the completion's reward (minus its
    group's mean for `baseline: group`), each sampled token t of it gets the return

        G_t = r - kl_coef * sum over its sampled tokens s >= t of kl_s,

    kl_s the estimator `kl_estimator` of the KL between the policy that generated the
    completion and the reference, at token s (k1: log pi - log pi_ref; k3: GRPO's);
    then every token's G over the whole rollout (all ranks, all the generation's steps)
    is normalized: (G - mean) / std, the std that of the tokens (OpenRLHF's). `kl_coef` 0:
    no KL and no reference model (the reward alone, normalized over the batch). The KL is
    the reward's here; `loss.beta` would add another, in the loss."""

    def __init__(self, baseline: str = "none", kl_coef: float = 0.0, kl_estimator: str = "k1"):
        problems = ReinforcePlusPlus.meaningless(
            {"baseline": baseline, "kl_coef": kl_coef, "kl_estimator": kl_estimator}
        )
        if problems:
            raise ValueError(" ".join(f"{key}: {why}" for key, why in problems.items()))
        self.baseline, self.kl_coef, self.kl_estimator = baseline, kl_coef, kl_estimator

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """Values the estimate would read as something else, by key: why, and the fix."""
        found = {}
        kl_coef = values.get("kl_coef", 0.0)
        if not (isinstance(kl_coef, (int, float)) and kl_coef >= 0):
            found["kl_coef"] = (
                "it weighs the KL to the reference subtracted from each token's reward; set 0 "
                "or more (0.01; 0: no KL and no reference model)."
            )
        for key, known, default in (
            ("kl_estimator", KL_ESTIMATORS, "k1"),
            ("baseline", TOKEN_BASELINES, "none"),
        ):
            value = values.get(key, default)
            if not (isinstance(value, str) and value in known):
                names = "; ".join(f"{name} ({what})" for name, what in known.items())
                found[key] = f"there is no {key} {value!r}; set one of: {names}."
        return found

    @property
    def needs_reference(self) -> bool:
        """Whether a KL to the reference model is folded into the reward (kl_coef > 0)."""
        return self.kl_coef > 0

    def centered(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """Each completion's reward, minus its group's mean for `baseline: group` (no std)."""
        rewards = rewards.float()
        if self.baseline == "none":
            return rewards
        grouped = rewards.view(-1, group_size)
        return (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)

    def returns(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        logps: torch.Tensor | None,
        ref_logps: torch.Tensor | None,
    ) -> torch.Tensor:
        """[R, T] each token's return: the completion's reward `rewards` [R] minus kl_coef
        times the KL summed over its sampled tokens from this one on (`mask` [R, T]; the
        log-probs [R, T] of the policy at generation and of the reference, read when
        kl_coef > 0). 0 off the mask."""
        mask = mask.bool()
        returns = rewards.float()[:, None].expand(mask.shape)
        if self.needs_reference:
            if logps is None or ref_logps is None:
                raise ValueError(
                    f"kl_coef={self.kl_coef} folds the KL to the reference into the reward: "
                    "pass the policy's and the reference's log-probs."
                )
            kl = torch.where(mask, kl_per_token(logps, ref_logps, self.kl_estimator), 0.0)
            to_come = kl.flip(-1).cumsum(-1).flip(-1)  # sum over s >= t
            returns = returns - self.kl_coef * to_come.float()
        return torch.where(mask, returns, 0.0)


def kl_per_token(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str) -> torch.Tensor:
    """An estimate per token of KL(pi || pi_ref) from the sampled token's log-probs:
    `KL_ESTIMATORS`' k1, k2 or k3 (k3's log-ratio clamped to [-10, 10], as OpenRLHF's)."""
    log_ratio = logps.float() - ref_logps.float()
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return log_ratio**2 / 2
    log_ratio = log_ratio.clamp(-10, 10)  # OpenRLHF's: exp stays finite where the two disagree
    return torch.exp(-log_ratio) + log_ratio - 1


def token_advantages(
    estimate: TokenAdvantages,
    batches: list[RolloutBatch],
    policy_logps: list[torch.Tensor] | None,
    groups: ParallelGroups,
) -> None:
    """Each batch's `advantages` [R, T], per token, from its centered rewards [R]: the
    estimate's returns (with a KL: from `policy_logps`, the policy's log-probs at generation
    per batch, and the batch's `ref_logps`), normalized by the mean and the std of every
    completion token of every batch on every dp rank (two sums over dp, which every rank
    calls). The std is the tokens' (not unbiased), clamped as OpenRLHF's."""
    returns, masks = [], []
    for i, batch in enumerate(batches):
        mask = batch.completion_mask()
        logps = None if policy_logps is None else policy_logps[i].cpu()
        ref = None if batch.ref_logps is None else batch.ref_logps.cpu()
        returns.append(estimate.returns(batch.advantages, mask, logps, ref).double())
        masks.append(mask)
    zero = torch.zeros((), dtype=torch.float64)
    sums = groups.sum(
        {
            "tokens": sum((m.sum() for m in masks), zero),
            "sum": sum((r.sum() for r in returns), zero),
        },
        over="dp",
    )
    tokens = max(float(sums["tokens"]), 1.0)
    mean = float(sums["sum"]) / tokens
    square = sum((torch.where(m, (r - mean) ** 2, 0.0).sum() for r, m in zip(returns, masks)), zero)
    var = float(groups.sum({"square": square}, over="dp")["square"]) / tokens
    scale = max(var, 1e-8) ** -0.5
    for batch, r, m in zip(batches, returns, masks):
        batch.advantages = torch.where(m, (r - mean) * scale, 0.0).float()

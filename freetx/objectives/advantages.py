"""Advantage estimates: how much better than its alternatives each completion of a
rollout did, the weight the policy-gradient loss gives its tokens.

A completion's advantage is its reward minus a baseline (`advantage:` in a GRPO config
names it: `GroupMean`, GRPO's; `LeaveOneOut`, RLOO's), divided by a std as
`loss.scale_rewards` says (its group's, the batch's, or none). A prompt's `group_size`
completions are adjacent rows (g * G ... g * G + G - 1). A new estimate is one class here
with a `__call__(grouped) -> baseline`, named by the config.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from freetx.objectives.grpo import SCALES, STD_EPS, _name_problem


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

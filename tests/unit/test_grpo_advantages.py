"""Group-relative advantages (freetx.objectives.group_advantages): each scale equals a direct
per-group computation, a group whose rewards are all equal gets exactly 0 and is counted,
and rewards that are not groups of numbers are refused."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from freetx.objectives import GroupAdvantages, group_advantages

G = 3
# 3 groups of 3: group 1's rewards are all equal, and their float32 mean is not 0.9
# (0.9 - mean != 0: only the zero-variance rule makes those advantages 0)
REWARDS = [1.0, 0.0, 0.0, 0.9, 0.9, 0.9, 2.0, -1.0, 0.5]


def direct(scale: str) -> list[float]:
    """Each reward minus its group's mean, over (the std + 1e-4) `scale` names."""
    out = []
    for g in range(0, len(REWARDS), G):
        group = REWARDS[g : g + G]
        mean = sum(group) / G
        std = {"group": statistics.stdev(group), "batch": statistics.stdev(REWARDS)}.get(scale)
        out += [(r - mean) / (std + 1e-4) if std is not None else r - mean for r in group]
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_each_scale_equals_the_direct_per_group_advantages(scale):
    result = group_advantages(torch.tensor(REWARDS), G, scale)
    assert isinstance(result, GroupAdvantages) and result.advantages.dtype == torch.float32
    want = [0.0 if 3 <= i < 6 else a for i, a in enumerate(direct(scale))]
    assert result.advantages.tolist() == pytest.approx(want, abs=1e-5)
    others = result.advantages[[0, 1, 2, 6, 7, 8]].view(2, G)
    assert (others.sum(-1).abs() <= 1e-5).all()  # centred per group


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_zero_variance_group_gets_advantages_of_exactly_0_and_is_counted(scale):
    rewards = torch.tensor(REWARDS)
    assert (rewards[3:6] - rewards[3:6].mean()).abs().max() > 0  # what float32 gives
    result = group_advantages(rewards, G, scale)
    assert result.advantages[3:6].tolist() == [0.0, 0.0, 0.0]
    assert result.zero_variance.tolist() == [False, True, False]


def test_integer_rewards_give_float32_advantages():
    result = group_advantages(torch.tensor([1, 0, 1, 1]), 2)
    assert result.advantages.dtype == torch.float32
    assert result.advantages[2:].tolist() == [0.0, 0.0] and result.advantages[0] > 0


REFUSED = {
    "rewards not in groups": (torch.zeros(7), G, "group", "not groups of 3"),
    "a group of one": (torch.zeros(4), 1, "group", "2 or more"),
    "an unknown scale": (torch.zeros(6), G, "std", "did you mean 'group'"),
    "a nan reward": (torch.tensor([0.0, float("nan"), 1.0]), G, "group", "rows [1]"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_rewards_that_are_not_groups_of_numbers_are_refused(case):
    rewards, size, scale, words = REFUSED[case]
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        group_advantages(rewards, size, scale)


def test_leave_one_out_compares_each_completion_with_the_others_mean():
    """RLOO's baseline: r_i - mean of the group's other rewards; divided as `scale` says."""
    from freetx.objectives import LeaveOneOut

    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 5.0, 5.0, 5.0, 5.0])
    found = group_advantages(rewards, 4, "none", LeaveOneOut())
    expected = [1 - 2 / 3, 0 - 3 / 3, 0 - 3 / 3, 2 - 1 / 3, 0, 0, 0, 0]
    assert found.advantages.tolist() == pytest.approx(expected)
    assert found.zero_variance.tolist() == [False, True]
    scaled = group_advantages(rewards, 4, "batch", LeaveOneOut(), batch_std=2.0)
    assert scaled.advantages.tolist() == pytest.approx([a / (2.0 + 1e-4) for a in expected])


def test_the_default_baseline_is_the_group_mean_bit_for_bit():
    from freetx.objectives import GroupMean

    rewards = torch.rand(12)
    for scale in ("group", "batch", "none"):
        default = group_advantages(rewards, 4, scale).advantages
        assert torch.equal(default, group_advantages(rewards, 4, scale, GroupMean()).advantages)


# REINFORCE++: two micro-batches of different widths (the rollout's), 2 prompts x 2 each;
# each row's completion tokens and the policy's / reference's log-probs at them
PROMPTS = [[5, 6], [7], [8, 9, 10], [11]]
COMPLETIONS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
PLUS_REWARDS = [1.0, 0.0, 0.5, 2.0]


def plus_batches():
    """The rollout's two RolloutBatches (rows 0-1, 2-3), their advantages the rewards, and
    per batch the policy's and the reference's log-probs at every label ([R, T])."""
    from freetx.data import RolloutBatch

    batches, policy = [], []
    for rows in ((0, 1), (2, 3)):
        b = RolloutBatch.of_rollouts([PROMPTS[i] for i in rows], [COMPLETIONS[i] for i in rows],
                                     torch.tensor([PLUS_REWARDS[i] for i in rows]))  # fmt: skip
        shape = b.labels.shape
        logps = -torch.arange(1, shape[0] * shape[1] + 1, dtype=torch.float).view(shape) / 7
        b.ref_logps = logps + torch.linspace(-0.3, 0.4, shape[0] * shape[1]).view(shape)
        batches.append(b)
        policy.append(logps)
    return batches, policy


def direct_plus(baseline, kl_coef, estimator):
    """OpenRLHF's REINFORCE++ as a loop: the reward (minus its group's mean) at the last
    token, -kl_coef * kl at each token, summed from each token to the end; every token's
    return normalized over all tokens (mean, then the tokens' std)."""
    batches, policy = plus_batches()
    rewards = list(PLUS_REWARDS)
    if baseline == "group":
        rewards = [PLUS_REWARDS[i] - (PLUS_REWARDS[i // 2 * 2] + PLUS_REWARDS[i // 2 * 2 + 1]) / 2
                   for i in range(4)]  # fmt: skip
    per_row = []
    for b, logps in zip(batches, policy):
        for j in range(b.labels.shape[0]):
            row = len(per_row)
            positions = [t for t in range(b.labels.shape[1]) if b.labels[j, t] != -100]
            step_rewards = []
            for t in positions:
                d = float(logps[j, t] - b.ref_logps[j, t])
                kl = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) + d - 1}[estimator]
                step_rewards.append(-kl_coef * kl)
            step_rewards[-1] += rewards[row]
            returns, to_come = [], 0.0
            for r in reversed(step_rewards):
                to_come += r
                returns.insert(0, to_come)
            per_row.append(dict(zip(positions, returns)))
    every = [v for row in per_row for v in row.values()]
    mean = sum(every) / len(every)
    std = (sum((v - mean) ** 2 for v in every) / len(every)) ** 0.5
    return [{t: (v - mean) / std for t, v in row.items()} for row in per_row]


@pytest.mark.parametrize("baseline,kl_coef,estimator",
                         [("none", 0.0, "k1"), ("none", 0.05, "k1"), ("group", 0.05, "k3"),
                          ("group", 0.2, "k2")])  # fmt: skip
def test_reinforce_plus_plus_equals_its_direct_loop_over_the_whole_rollout(
    baseline, kl_coef, estimator
):
    from freetx.distributed import DistributedRuntime, ParallelGroups
    from freetx.objectives import ReinforcePlusPlus
    from freetx.objectives.advantages import token_advantages

    estimate = ReinforcePlusPlus(baseline, kl_coef, estimator)
    batches, policy = plus_batches()
    for b in batches:  # as the rollout does: centered by the group of 2 first
        b.advantages = estimate.centered(b.advantages, 2)
    groups = ParallelGroups(DistributedRuntime(0, 0, 1, torch.device("cpu")))
    token_advantages(estimate, batches, policy if kl_coef else None, groups)
    want = direct_plus(baseline, kl_coef, estimator)
    row = 0
    for b in batches:
        assert b.advantages.shape == b.labels.shape and b.advantages.dtype == torch.float32
        for j in range(b.labels.shape[0]):
            for t in range(b.labels.shape[1]):
                expected = want[row].get(t, 0.0)  # 0 off the completion
                assert b.advantages[j, t].item() == pytest.approx(expected, abs=1e-5)
            row += 1


def test_reinforce_plus_plus_needs_a_reference_only_for_a_kl_and_refuses_nonsense():
    from freetx.objectives import ReinforcePlusPlus

    assert not ReinforcePlusPlus().needs_reference
    assert ReinforcePlusPlus(kl_coef=0.01).needs_reference
    for values, key in (({"kl_coef": -1}, "kl_coef"), ({"kl_estimator": "k4"}, "kl_estimator"),
                        ({"baseline": "mean"}, "baseline")):  # fmt: skip
        assert key in ReinforcePlusPlus.meaningless(values)
        with pytest.raises(ValueError, match=key):
            ReinforcePlusPlus(**values)
    with pytest.raises(ValueError, match="log-probs"):
        ReinforcePlusPlus(kl_coef=0.1).returns(torch.ones(1), torch.ones(1, 2), None, None)

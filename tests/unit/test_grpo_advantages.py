"""Group-relative advantages (freetx.objectives.group_advantages): each scale equals a direct
per-group computation, a group whose rewards are all equal gets exactly 0 and is counted,
and rewards that are not groups of numbers are refused."""

from __future__ import annotations

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

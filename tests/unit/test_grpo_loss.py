"""The GRPO objective (freetx.objectives.GRPOLoss): each aggregation and importance sampling,
with and without the KL term, equals a direct per-token loop of its paper's formula on a
hand-made batch whose ratios clip on both sides, in values and in gradients; micro-batches
summed over their summed units give the whole batch; padding reaches nothing; the
metrics; the values it refuses before anything is built."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from freetx.config.instantiate import check_components
from freetx.objectives import GRPOLoss

LOW, HIGH, BETA, MAX_LENGTH = 0.2, 0.28, 0.1, 8
ADVANTAGES = [1.2, -0.7, 0.9, -1.1]
# each row's completion tokens' log pi - log pi_old: row 0 (A > 0) clips above per token
# and per sequence (mean 0.34); row 1 (A < 0) clips below per token and per sequence (mean
# -0.3); row 2 has a ratio below 1 - LOW with A > 0 and one above 1 + HIGH; row 3 (A < 0)
# is above 1 + HIGH per token and per sequence, which does not clip with A < 0
LOG_RATIOS = [[0.5, 0.6, -0.4, 0.3, 0.7], [-0.5, -0.1, -0.3], [0.1, -0.3, 0.4, -0.05], [0.45, 0.2]]
REF_SHIFT = [[0.3, -0.2, 0.5, 0.1, -0.4], [0.2, 0.6, -0.3], [-0.1, 0.25, 0.0, 0.4], [-0.5, 0.35]]
R, T = 4, 5
GARBAGE = (1e4, -1e4, 3e4)  # logps, old and ref where the mask is off: exp(2e4) is inf


def batch():
    """(logps, old_logps, ref_logps, advantages, mask) of the hand-made batch, padded."""
    mask = torch.zeros(R, T, dtype=torch.bool)
    logps = torch.full((R, T), GARBAGE[0])
    old, ref = torch.full((R, T), GARBAGE[1]), torch.full((R, T), GARBAGE[2])
    for i, ratios in enumerate(LOG_RATIOS):
        for t, d in enumerate(ratios):
            mask[i, t] = True
            logps[i, t] = -(0.3 + 0.2 * t + 0.1 * i)
            old[i, t] = logps[i, t] - d
            ref[i, t] = logps[i, t] + REF_SHIFT[i][t]
    return logps.requires_grad_(), old, ref, torch.tensor(ADVANTAGES), mask


def direct(logps, old, ref, aggregation, level, beta, per_token=None):
    """The batch mean of the loss in a python loop over each completion's tokens (each
    token's advantage `per_token[i][t]` where given, else its row's)."""
    total, units = torch.zeros(()), 0
    for i, ratios in enumerate(LOG_RATIOS):
        tokens = range(len(ratios))
        if level == "sequence":  # GSPO: (pi(y|x) / pi_old(y|x)) ** (1 / |y|)
            seq = torch.exp(sum(logps[i, t] - old[i, t] for t in tokens) / len(tokens))
        row = torch.zeros(())
        for t in tokens:
            a = ADVANTAGES[i] if per_token is None else per_token[i][t]
            rho = seq if level == "sequence" else torch.exp(logps[i, t] - old[i, t])
            term = -torch.minimum(rho * a, torch.clamp(rho, 1 - LOW, 1 + HIGH) * a)
            if beta:
                q = ref[i, t] - logps[i, t]
                term = term + beta * (torch.exp(q) - q - 1)
            row = row + term
        if aggregation == "token":  # DAPO
            total, units = total + row, units + len(tokens)
        elif aggregation == "sequence":  # GRPO
            total, units = total + row / len(tokens), units + 1
        else:  # Dr. GRPO
            total, units = total + row / MAX_LENGTH, units + 1
    return total / units


def mean_loss(loss: GRPOLoss, logps, old, ref, advantages, mask):
    """The loss and the metrics of a batch in one micro-batch: their sums over its units."""
    summed, metrics = loss(logps, old, ref, advantages, mask, max_completion_length=MAX_LENGTH)
    units = loss.units(mask)
    return summed / units, {name: value / units for name, value in metrics.items()}


VARIANTS = [
    (aggregation, level, beta)
    for aggregation in ("token", "sequence", "fixed")
    for level in ("token", "sequence")
    for beta in (0.0, BETA)
]


@pytest.mark.parametrize("aggregation,level,beta", VARIANTS)
def test_each_variant_equals_its_direct_per_token_loop_in_values_and_gradients(
    aggregation, level, beta
):
    logps, old, ref, advantages, mask = batch()
    loss = GRPOLoss(LOW, HIGH, beta, aggregation, level)
    value, _ = mean_loss(loss, logps, old, ref, advantages, mask)
    (grad,) = torch.autograd.grad(value, logps)
    want_logps = batch()[0]
    want = direct(want_logps, old, ref, aggregation, level, beta)
    (want_grad,) = torch.autograd.grad(want, want_logps)
    assert value.dtype == torch.float32 and abs(value.item() - want.item()) <= 1e-5
    assert (grad - want_grad).abs().max().item() <= 1e-5
    assert (grad[mask] != 0).sum() > 0 and (grad[~mask] == 0).all()


@pytest.mark.parametrize("aggregation,level", [("token", "token"), ("sequence", "sequence")])
def test_advantages_per_token_weigh_each_token_by_its_own(aggregation, level):
    """REINFORCE++'s [R, T] advantages: each token's own, of both signs within a row (so
    a row clips on one side at some tokens and the other at others); garbage off the mask
    reaches nothing."""
    logps, old, ref, _, mask = batch()
    per_token = [[ADVANTAGES[i] * (1 - 0.6 * t) for t in range(len(r))]
                 for i, r in enumerate(LOG_RATIOS)]  # fmt: skip
    table = torch.full((R, T), 1e4)
    for i, row in enumerate(per_token):
        table[i, : len(row)] = torch.tensor(row)
    loss = GRPOLoss(LOW, HIGH, BETA, aggregation, level)
    value, _ = mean_loss(loss, logps, old, ref, table, mask)
    (grad,) = torch.autograd.grad(value, logps)
    want_logps = batch()[0]
    want = direct(want_logps, old, ref, aggregation, level, BETA, per_token)
    (want_grad,) = torch.autograd.grad(want, want_logps)
    assert abs(value.item() - want.item()) <= 1e-5
    assert (grad - want_grad).abs().max().item() <= 1e-5 and (grad[~mask] == 0).all()


def test_padding_garbage_reaches_neither_the_loss_nor_the_gradients():
    logps, old, ref, advantages, mask = batch()
    loss = GRPOLoss(LOW, HIGH, BETA, "sequence", "sequence")
    value, metrics = loss(logps, old, ref, advantages, mask)
    (grad,) = torch.autograd.grad(value, logps)
    clean = [torch.where(mask, x.detach(), 0.0) for x in (logps, old, ref)]
    want, want_metrics = loss(*clean, advantages, mask)
    assert torch.isfinite(grad).all() and (grad[~mask] == 0).all()
    assert value.item() == pytest.approx(want.item(), abs=1e-6)
    assert {k: v.item() for k, v in metrics.items()} == pytest.approx(
        {k: v.item() for k, v in want_metrics.items()}, abs=1e-6
    )


def clipped_tokens(level: str) -> dict[str, list[list[bool]]]:
    """Which tokens' ratios were clipped below (A < 0) and above (A > 0), per row."""
    low, high = [], []
    for ratios, a in zip(LOG_RATIOS, ADVANTAGES):
        rhos = [math.exp(sum(ratios) / len(ratios))] * len(ratios) if level == "sequence" else [
            math.exp(d) for d in ratios
        ]  # fmt: skip
        low.append([rho < 1 - LOW and a < 0 for rho in rhos])
        high.append([rho > 1 + HIGH and a > 0 for rho in rhos])
    return {"low": low, "high": high}


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_clip_ratios_are_the_shares_clipped_below_above_and_either(level, aggregation):
    logps, old, ref, advantages, mask = batch()
    loss = GRPOLoss(LOW, HIGH, 0.0, aggregation, level)
    _, metrics = mean_loss(loss, logps, old, ref, advantages, mask)
    clipped = clipped_tokens(level)
    either = [[lo or hi for lo, hi in zip(*rows)] for rows in zip(clipped["low"], clipped["high"])]
    for name, rows in (("low", clipped["low"]), ("high", clipped["high"]), ("region", either)):
        if aggregation == "token":
            want = sum(map(sum, rows)) / sum(map(len, rows))
        else:
            want = sum(sum(row) / len(row) for row in rows) / len(rows)
        assert metrics[f"clip_ratio/{name}_mean"].item() == pytest.approx(want, abs=1e-6)
        assert want > 0  # the batch clips on both sides at both levels
    assert not any(v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("aggregation", ["token", "fixed"])
def test_the_kl_metric_is_the_k3_mean_and_only_logged_with_beta(aggregation):
    logps, old, ref, advantages, mask = batch()
    _, metrics = mean_loss(GRPOLoss(beta=BETA, aggregation=aggregation), logps, old, ref,
                           advantages, mask)  # fmt: skip
    per_row = [[math.exp(s) - s - 1 for s in row] for row in REF_SHIFT]  # q = ref - logp
    if aggregation == "token":
        want = sum(map(sum, per_row)) / sum(map(len, per_row))
    else:
        want = sum(sum(row) / len(row) for row in per_row) / len(per_row)
    assert metrics["kl"].item() == pytest.approx(want, abs=1e-6)
    _, without = mean_loss(GRPOLoss(), logps, old, ref, advantages, mask)
    assert "kl" not in without


@pytest.mark.parametrize("aggregation", ["token", "sequence", "fixed"])
def test_without_old_log_probs_the_ratio_is_1_and_the_gradient_the_plain_policy_gradient(
    aggregation,
):
    logps, _, ref, advantages, mask = batch()
    for level in ("token", "sequence"):
        value, metrics = mean_loss(GRPOLoss(LOW, HIGH, 0.0, aggregation, level), logps, None,
                                   None, advantages, mask)  # fmt: skip
        (grad,) = torch.autograd.grad(value, logps)
        lengths = mask.sum(-1, keepdim=True).float()
        per_unit = {"token": mask.sum(), "sequence": lengths * R, "fixed": MAX_LENGTH * R}
        want = torch.where(mask, -advantages[:, None] / per_unit[aggregation], 0.0)
        assert value.item() == pytest.approx(want.sum().item(), abs=1e-6)  # rho = 1
        assert (grad - want).abs().max().item() <= 1e-6
        assert all(v.item() == 0 for v in metrics.values())


@pytest.mark.parametrize("aggregation", ["token", "sequence", "fixed"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_two_micro_batches_summed_over_their_summed_units_equal_the_whole_batch(aggregation, level):
    logps, old, ref, advantages, mask = batch()
    loss = GRPOLoss(LOW, HIGH, BETA, aggregation, level)
    whole, whole_metrics = mean_loss(loss, logps, old, ref, advantages, mask)
    (whole_grad,) = torch.autograd.grad(whole, logps)
    parts = [slice(0, 1), slice(1, 4)]
    sums = [loss(logps[p], old[p], ref[p], advantages[p], mask[p], MAX_LENGTH) for p in parts]
    units = sum(loss.units(mask[p]) for p in parts)
    split = sum(summed for summed, _ in sums) / units
    (split_grad,) = torch.autograd.grad(split, logps)
    assert split.item() == pytest.approx(whole.item(), abs=1e-6)
    assert (split_grad - whole_grad).abs().max().item() <= 1e-6
    for name, value in whole_metrics.items():
        assert (sum(m[name] for _, m in sums) / units).item() == pytest.approx(value.item())


def test_units_are_the_completion_tokens_or_the_completions():
    mask = batch()[-1]
    assert GRPOLoss(aggregation="token").units(mask).item() == 14
    assert GRPOLoss(aggregation="sequence").units(mask).item() == R
    assert GRPOLoss(aggregation="fixed").units(mask).item() == R


def test_beta_needs_the_reference_log_probs_and_builds_a_reference():
    logps, old, _, advantages, mask = batch()
    assert GRPOLoss(beta=BETA).needs_reference and not GRPOLoss().needs_reference
    with pytest.raises(ValueError, match="ref_logps"):
        GRPOLoss(beta=BETA)(logps, old, None, advantages, mask)


def test_fixed_aggregation_needs_max_completion_length():
    logps, old, ref, advantages, mask = batch()
    with pytest.raises(ValueError, match="max_completion_length"):
        GRPOLoss(aggregation="fixed")(logps, old, ref, advantages, mask)


def test_advantages_not_one_per_row_are_refused():
    logps, old, ref, advantages, mask = batch()
    with pytest.raises(ValueError, match="do not match"):
        GRPOLoss()(logps, old, ref, advantages[:2], mask)


def test_epsilon_high_defaults_to_epsilon_low():
    assert GRPOLoss(epsilon_low=0.3).epsilon_high == 0.3
    assert GRPOLoss(epsilon_low=0.2, epsilon_high=0.28).epsilon_high == 0.28


MEANINGLESS = {
    "negative epsilon_low": (dict(epsilon_low=-0.1), "epsilon_low", "0 or more"),
    "epsilon_low of 1": (dict(epsilon_low=1.0), "epsilon_low", "below 1"),
    "negative epsilon_high": (dict(epsilon_high=-0.2), "epsilon_high", "0 or more"),
    "negative beta": (dict(beta=-0.04), "beta", "0 or more"),
    "aggregation named dapo": (dict(aggregation="dapo"), "aggregation", "did you mean 'token'"),
    "aggregation named dr_grpo": (
        dict(aggregation="dr_grpo"), "aggregation", "did you mean 'fixed'",
    ),
    "aggregation misspelt": (dict(aggregation="sequnce"), "aggregation", "did you mean 'sequence'"),
    "importance sampling named gspo": (
        dict(importance_sampling="gspo"), "importance_sampling", "did you mean 'sequence'",
    ),
    "scale_rewards as trl's false": (
        dict(scale_rewards=False), "scale_rewards", "did you mean 'none'",
    ),
    "scale_rewards unknown": (dict(scale_rewards="whiten"), "scale_rewards", "set one of"),
    "num_chunks of 0": (dict(num_chunks=0), "num_chunks", "1 or more"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(MEANINGLESS))
def test_meaningless_values_are_refused_before_building_and_when_built(case):
    values, key, words = MEANINGLESS[case]
    found = GRPOLoss.meaningless(values)
    assert list(found) == [key] and words in found[key]
    with pytest.raises(ValueError, match=key):
        GRPOLoss(**values)
    node = OmegaConf.create({"loss": {"_component_": "freetx.objectives.GRPOLoss", **values}})
    assert any(f"'loss.{key}'" in problem for problem in check_components(node))


def test_sensible_values_are_not_meaningless():
    assert GRPOLoss.meaningless({}) == {}
    assert GRPOLoss.meaningless(
        dict(epsilon_low=0.2, epsilon_high=0.28, beta=0.04, aggregation="fixed",
             importance_sampling="sequence", scale_rewards="none", num_chunks=2)
    ) == {}  # fmt: skip

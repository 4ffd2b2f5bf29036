"""The preference losses (freetx.objectives.PreferenceLoss): each type equals a direct,
per-pair implementation of its paper's formula on a hand-made batch, in values and in
gradients; the metrics TRL logs; the values it refuses before anything is built; which
types need a reference; a sequence's log-probabilities through a model's forward."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from freetx.config.instantiate import check_components
from freetx.distributed import materialize
from freetx.models.protocol import LMOutput
from freetx.models.transformer import decoder
from freetx.objectives import PreferenceLoss, SequenceLogProbs, sequence_logps

# 4 pairs, chosen and rejected interleaved: summed log-probs and loss tokens of each row;
# pair 0 is past the hinge (beta h > 1), pair 1 prefers the rejected, pair 3's means are near
# 0 (orpo's near branch)
POLICY = [-10.0, -15.5, -20.0, -14.0, -8.5, -18.0, -0.3, -0.9]
REFERENCE = [-13.0, -14.0, -19.0, -16.5, -9.0, -17.0, -0.4, -0.6]
TOKENS = [6.0, 7.0, 9.0, 5.0, 4.0, 8.0, 3.0, 4.0]
BETA, EPS, GAMMA, ALPHA = 0.3, 0.15, 0.4, 0.7


def logsig(x):
    return torch.log(torch.sigmoid(x))


def direct(kind: str, pol, ref, tokens, rpo: bool = False):
    """Each pair's loss in a python loop, the formula as its paper writes it."""
    total = torch.zeros(())
    for i in range(len(tokens) // 2):
        pc, pr, rc, rr = pol[2 * i], pol[2 * i + 1], ref[2 * i], ref[2 * i + 1]
        nc, nr = tokens[2 * i], tokens[2 * i + 1]
        h = (pc - rc) - (pr - rr)
        if kind == "sigmoid":  # cDPO with label smoothing
            loss = -(1 - EPS) * logsig(BETA * h) - EPS * logsig(-BETA * h)
        elif kind == "robust":
            loss = (-(1 - EPS) * logsig(BETA * h) + EPS * logsig(-BETA * h)) / (1 - 2 * EPS)
        elif kind == "ipo":  # on the mean token log-probabilities
            h_mean = (pc / nc - rc / nc) - (pr / nr - rr / nr)
            loss = (h_mean - 1 / (2 * BETA)) ** 2
        elif kind == "hinge":
            loss = torch.clamp(1 - BETA * h, min=0)
        elif kind == "simpo":
            loss = -logsig(BETA / nc * pc - BETA / nr * pr - GAMMA)
        elif kind == "orpo":
            mc, mr = pc / nc, pr / nr
            odds_c = mc - torch.log(1 - torch.exp(mc))
            odds_r = mr - torch.log(1 - torch.exp(mr))
            loss = -mc - BETA * logsig(odds_c - odds_r)
        if rpo:
            loss = loss + ALPHA * -(pc / nc)
        total = total + loss
    return total


def batch():
    policy = torch.tensor(POLICY, requires_grad=True)
    return policy, SequenceLogProbs(policy, torch.tensor(TOKENS))


def loss_of(kind: str, rpo: bool = False):
    smoothing = EPS if kind in ("sigmoid", "robust") else 0.0
    return PreferenceLoss(
        kind, beta=BETA, label_smoothing=smoothing, gamma=GAMMA, rpo_alpha=ALPHA if rpo else None
    )


CASES = [(kind, False) for kind in ("sigmoid", "robust", "ipo", "hinge", "simpo", "orpo")] + [
    ("sigmoid", True),
    ("simpo", True),
]


@pytest.mark.parametrize("kind,rpo", CASES)
def test_each_loss_equals_its_direct_per_pair_formula_in_values_and_gradients(kind, rpo):
    policy, logps = batch()
    reference = SequenceLogProbs(torch.tensor(REFERENCE), torch.tensor(TOKENS))
    loss, _ = loss_of(kind, rpo)(logps, reference)
    (grad,) = torch.autograd.grad(loss, policy)
    direct_policy = torch.tensor(POLICY, requires_grad=True)
    want = direct(kind, direct_policy, torch.tensor(REFERENCE), TOKENS, rpo)
    (want_grad,) = torch.autograd.grad(want, direct_policy)
    assert loss.dtype == torch.float32 and abs(loss.item() - want.item()) <= 1e-5
    assert (grad - want_grad).abs().max().item() <= 1e-5
    assert (grad != 0).any()


def test_the_sigmoid_loss_of_a_policy_equal_to_its_reference_is_ln_2_per_pair():
    _, logps = batch()
    loss, metrics = PreferenceLoss()(logps, logps)
    assert loss.item() == pytest.approx(4 * math.log(2), abs=1e-6)
    assert metrics["rewards/accuracies"].item() == 0 and metrics["rewards/margins"].item() == 0


def test_the_metrics_are_sums_over_pairs_of_trls_rewards_and_log_probs():
    _, logps = batch()
    reference = SequenceLogProbs(torch.tensor(REFERENCE), torch.tensor(TOKENS))
    _, metrics = PreferenceLoss(beta=BETA)(logps, reference)
    chosen = [BETA * (POLICY[i] - REFERENCE[i]) for i in range(0, 8, 2)]
    rejected = [BETA * (POLICY[i] - REFERENCE[i]) for i in range(1, 8, 2)]
    want = {
        "rewards/chosen": sum(chosen),
        "rewards/rejected": sum(rejected),
        "rewards/accuracies": sum(c > r for c, r in zip(chosen, rejected)),  # 3 of 4
        "rewards/margins": sum(chosen) - sum(rejected),
        "logps/chosen": sum(POLICY[0::2]),
        "logps/rejected": sum(POLICY[1::2]),
    }
    assert want["rewards/accuracies"] == 3
    assert {k: v.item() for k, v in metrics.items()} == pytest.approx(want, abs=1e-5)
    assert not any(v.requires_grad for v in metrics.values())


def test_reference_free_rewards_are_beta_times_the_mean_log_probs():
    _, logps = batch()
    for kind in ("simpo", "orpo"):
        _, metrics = PreferenceLoss(kind, beta=BETA)(logps, None)
        want = sum(BETA * POLICY[i] / TOKENS[i] for i in range(0, 8, 2))
        assert metrics["rewards/chosen"].item() == pytest.approx(want, abs=1e-5)


def test_orpo_and_rpo_alpha_log_the_chosens_nll():
    _, logps = batch()
    nll = sum(-POLICY[i] / TOKENS[i] for i in range(0, 8, 2))
    _, orpo = PreferenceLoss("orpo", beta=BETA)(logps, None)
    assert orpo["nll_loss"].item() == pytest.approx(nll, abs=1e-5)
    assert orpo.keys() >= {"log_odds_ratio", "log_odds_chosen"}
    assert orpo["log_odds_ratio"].item() < 0  # a sum of log sigmoids
    reference = SequenceLogProbs(torch.tensor(REFERENCE), torch.tensor(TOKENS))
    _, rpo = PreferenceLoss(rpo_alpha=1.0)(logps, reference)
    assert rpo["nll_loss"].item() == pytest.approx(nll, abs=1e-5)


def test_only_simpo_and_orpo_need_no_reference():
    needs = {kind: PreferenceLoss(kind).needs_reference for kind in
             ("sigmoid", "robust", "ipo", "hinge", "simpo", "orpo")}  # fmt: skip
    assert [kind for kind, yes in needs.items() if not yes] == ["simpo", "orpo"]
    with pytest.raises(ValueError, match="reference"):
        PreferenceLoss("sigmoid")(batch()[1], None)


MEANINGLESS = {
    "an unknown type, with the closest": (dict(type="sigmod"), "type", "did you mean 'sigmoid'"),
    "beta of 0": (dict(beta=0.0), "beta", "positive"),
    "infinite beta": (dict(beta=float("inf")), "beta", "finite positive"),
    "negative simpo gamma": (dict(type="simpo", gamma=-1.0), "gamma", "target reward margin"),
    "nan gamma": (dict(type="simpo", gamma=float("nan")), "gamma", "0 or more"),
    "label smoothing of one half": (dict(label_smoothing=0.5), "label_smoothing", "below 0.5"),
    "negative label smoothing": (dict(label_smoothing=-0.1), "label_smoothing", "below 0.5"),
    "label smoothing of hinge": (
        dict(type="hinge", label_smoothing=0.1), "label_smoothing", "no label smoothing",
    ),
    "negative rpo_alpha": (dict(rpo_alpha=-1.0), "rpo_alpha", "0 or more"),
    "rpo_alpha with orpo": (dict(type="orpo", rpo_alpha=1.0), "rpo_alpha", "already"),
    "num_chunks of 0": (dict(num_chunks=0), "num_chunks", "1 or more"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(MEANINGLESS))
def test_meaningless_values_are_refused_before_building_and_when_built(case):
    values, key, words = MEANINGLESS[case]
    found = PreferenceLoss.meaningless(values)
    assert list(found) == [key] and words in found[key]
    with pytest.raises(ValueError, match=key):
        PreferenceLoss(**values)
    node = OmegaConf.create({"loss": {"_component_": "freetx.objectives.PreferenceLoss", **values}})
    assert any(f"'loss.{key}'" in problem for problem in check_components(node))


def test_sensible_values_are_not_meaningless():
    assert PreferenceLoss.meaningless({}) == {}
    assert PreferenceLoss.meaningless(dict(type="robust", label_smoothing=0.2, rpo_alpha=0)) == {}


SMALL = dict(vocab_size=96, hidden_dim=32, num_layers=1, num_heads=4, num_kv_heads=2,
             ffn_hidden_dim=48, max_seq_len=32)  # fmt: skip


@pytest.mark.parametrize("moe", [False, True])
def test_sequence_logps_sums_each_rows_loss_tokens_through_the_forward(moe):
    experts = dict(num_experts=4, experts_per_token=2, moe_ffn_hidden_dim=24) if moe else {}
    with torch.device("meta"):
        model = decoder(**SMALL, **experts)
    materialize(model, torch.device("cpu"), seed=3)
    ids = torch.randint(0, 96, (4, 10), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, :4] = -100  # the prompt
    labels[3, 8:] = -100  # padding
    logps, output = sequence_logps(model.train(), ids, labels, num_chunks=3)
    assert isinstance(output, LMOutput) == moe
    logits = model(ids)
    logits = (logits[0] if moe else logits).float().log_softmax(-1)
    per_token = logits.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * (labels >= 0)
    assert torch.allclose(logps.sum, per_token.sum(-1), atol=1e-5)
    assert logps.tokens.tolist() == [6.0, 6.0, 6.0, 4.0]
    assert logps.chosen().sum.shape == (2,) and logps.sum.requires_grad
    assert torch.allclose(logps.rejected().mean(), per_token.sum(-1)[1::2] / torch.tensor([6, 4]))

"""KTO (freetx.objectives.KTOLoss, freetx.data.UnpairedPreferenceDataset): the loss and
TRL's metrics equal TRL's formula written as a loop over one batch (its KL baseline from
the batch's mismatched rows, clamped at 0); the baseline over micro-batches is the whole
batch's; unpaired rows are read (strings and conversations) with each example's KL row
from the nearest earlier example of another prompt; bad rows and one-prompt data are
refused; meaningless values are refused."""

from __future__ import annotations

import json
import math

import pytest
import torch

from freetx.data.formats import DEFAULT_COLUMNS, BadRow, Format, Unpaired
from freetx.data.preference import with_kl_completions
from freetx.data.sources import format_of_shape
from freetx.errors import DataError
from freetx.objectives import KTOBaseline, KTOLoss
from freetx.objectives.kto import kl_sums
from freetx.objectives.logprobs import SequenceLogProbs

BETA, W_D, W_U = 0.3, 1.0, 1.5
DESIRABLE = [True, False, True, True, False, False, True, False]


def batch(seed: int = 0):
    """Summed log-probs of 8 examples and of their KL rows, the policy's and the reference's."""
    g = torch.Generator().manual_seed(seed)
    policy, reference, kl_policy, kl_reference = (
        -torch.rand(8, generator=g) * 20 for _ in range(4)
    )
    kl_policy = kl_reference + torch.linspace(-0.5, 3.0, 8)  # a positive mean: not clamped
    return policy, reference, kl_policy, kl_reference


def trl(policy, reference, kl_policy, kl_reference):
    """TRL's KTOTrainer (loss_type kto) on one batch, as a loop: the loss (nanmean over the
    examples) and its metrics (means over each kind)."""
    kl = max(sum(float(a - b) for a, b in zip(kl_policy, kl_reference)) / 8, 0.0)
    losses, chosen, rejected, logps_c, logps_r = [], [], [], [], []
    for i, good in enumerate(DESIRABLE):
        ratio = float(policy[i] - reference[i])
        if good:
            losses.append(W_D * (1 - 1 / (1 + math.exp(-BETA * (ratio - kl)))))
            chosen.append(BETA * ratio)
            logps_c.append(float(policy[i]))
        else:
            losses.append(W_U * (1 - 1 / (1 + math.exp(-BETA * (kl - ratio)))))
            rejected.append(BETA * ratio)
            logps_r.append(float(policy[i]))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return (
        sum(losses) / len(losses),
        kl,
        {
            "rewards/chosen": mean(chosen),
            "rewards/rejected": mean(rejected),
            "rewards/margins": mean(chosen) - mean(rejected),
            "logps/chosen": mean(logps_c),
            "logps/rejected": mean(logps_r),
        },
    )


def logps(sums: torch.Tensor) -> SequenceLogProbs:
    return SequenceLogProbs(sums, torch.full_like(sums, 5.0))


@pytest.mark.parametrize("split", [[8], [3, 5], [1, 4, 3]])
def test_the_loss_and_metrics_equal_trls_formula_however_the_batch_is_split(split):
    """The baseline summed over micro-batches, each micro-batch's loss summed, all divided
    by the examples: TRL's mean loss and per-kind means on the whole batch."""
    policy, reference, kl_policy, kl_reference = batch()
    want_loss, want_kl, want = trl(policy, reference, kl_policy, kl_reference)
    labels = torch.tensor(DESIRABLE)
    parts = list(
        zip(*(t.split(split) for t in (policy, reference, kl_policy, kl_reference, labels)))
    )
    sums: dict = {}
    for _, _, kp, kr, d in parts:
        for name, value in kl_sums(logps(kp), logps(kr), d).items():
            sums[name] = sums.get(name, 0) + value
    baseline = KTOBaseline.of(sums)
    assert baseline.kl == pytest.approx(want_kl) and baseline.kl > 0
    loss_fn = KTOLoss(BETA, W_D, W_U)
    total, metrics = torch.zeros(()), {}
    for p, r, _, _, d in parts:
        loss, found = loss_fn(logps(p), logps(r), d, baseline)
        total = total + loss
        for name, value in found.items():
            metrics[name] = metrics.get(name, 0) + value
    assert (total / 8).item() == pytest.approx(want_loss, abs=1e-6)
    for name, value in want.items():
        assert (metrics[name] / 8).item() == pytest.approx(value, abs=1e-5), name


def test_the_baseline_is_clamped_at_0_and_not_differentiated():
    policy, reference, kl_policy, kl_reference = batch(1)
    baseline = KTOBaseline.of(
        kl_sums(logps(kl_reference - 2.0), logps(kl_reference), torch.tensor(DESIRABLE))
    )
    assert baseline.kl == 0.0 and baseline.desirable == 4 and baseline.undesirable == 4
    policy = policy.clone().requires_grad_()
    loss, _ = KTOLoss(BETA)(logps(policy), logps(reference), torch.tensor(DESIRABLE), baseline)
    loss.backward()
    good = torch.tensor(DESIRABLE)
    assert (policy.grad[good] < 0).all() and (policy.grad[~good] > 0).all()  # up / down


def test_at_the_reference_each_example_loses_half_its_weight():
    """The first step of a run (the policy is its reference): r = z = 0."""
    same = -torch.rand(8) * 10
    baseline = KTOBaseline.of(kl_sums(logps(same), logps(same), torch.tensor(DESIRABLE)))
    loss, _ = KTOLoss(BETA, W_D, W_U)(logps(same), logps(same), torch.tensor(DESIRABLE), baseline)
    assert loss.item() == pytest.approx(0.5 * (4 * W_D + 4 * W_U))


UNPAIRED = Format("unpaired", DEFAULT_COLUMNS["unpaired"])


def test_unpaired_rows_strings_and_conversations():
    row = {"prompt": "2+2?", "completion": "4", "label": True}
    assert UNPAIRED.unpaired(row) == Unpaired("2+2?", "4", True)
    assert format_of_shape(row) == ("unpaired", {})
    chat = {"prompt": [{"role": "user", "content": "hi"}],
            "completion": [{"role": "assistant", "content": "hello"}], "label": 0}  # fmt: skip
    assert UNPAIRED.unpaired(chat).desirable is False
    for bad, says in (({**row, "label": "yes"}, "boolean"), ({**row, "completion": " "}, "empty"),
                      ({**row, "label": 0.5}, "boolean")):  # fmt: skip
        with pytest.raises(BadRow, match=says):
            UNPAIRED.unpaired(bad)


def test_each_kl_row_takes_the_nearest_earlier_example_of_another_prompt():
    examples = [(f"row {i}", Unpaired(p, c, i % 2 == 0))
                for i, (p, c) in enumerate([("a", "1"), ("a", "2"), ("b", "3"), ("c", "4")])]  # fmt: skip
    pairs = with_kl_completions(examples)
    assert [(pair.prompt, pair.chosen, pair.rejected, label) for _, (pair, label) in pairs] == [
        ("a", "1", "4", True),  # cyclic: the last one
        ("a", "2", "4", False),  # row 0 has the same prompt
        ("b", "3", "2", True),
        ("c", "4", "3", False),
    ]
    with pytest.raises(DataError, match="2 or more prompts"):
        with_kl_completions(examples[:2])


def test_the_dataset_serves_each_example_with_its_kl_row_and_label(tmp_path):
    from freetx.data import ByteTokenizer, UnpairedPreferenceDataset, collate_pairs

    rows = tmp_path / "unpaired.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Q{i}?", "completion": f"A{i}", "label": i % 3 == 0}) + "\n"
                            for i in range(6)))  # fmt: skip
    data = UnpairedPreferenceDataset(source=str(rows), tokenizer=ByteTokenizer(), seq_len=32,
                                     split="train", val_fraction=0.0, cache=False)  # fmt: skip
    assert len(data) == 6 and data.summary().unit == "examples"
    tok = ByteTokenizer()
    text = lambda s: tok.decode([int(t) for t in s["input_ids"] if 0 <= t < 256])  # noqa: E731
    example, kl_row = data[2]
    assert "Q2?" in text(example) and text(example).endswith("A2")
    assert "Q2?" in text(kl_row) and text(kl_row).endswith("A1")
    batch = collate_pairs([data[i] for i in range(3)])
    assert batch.desirable.tolist() == [True, True, False, False, False, False]
    assert batch.chosen_rows().desirable.tolist() == [True, False, False]
    with pytest.raises(DataError, match="packed"):
        UnpairedPreferenceDataset(source=str(rows), tokenizer=ByteTokenizer(), seq_len=32,
                                  split="train", val_fraction=0.0, cache=False, packed=True)  # fmt: skip


@pytest.mark.parametrize("values, key", [({"beta": 0}, "beta"), ({"desirable_weight": -1}, "desirable_weight"),
                                         ({"desirable_weight": 0, "undesirable_weight": 0}, "desirable_weight")])  # fmt: skip
def test_meaningless_values_are_refused(values, key):
    assert key in KTOLoss.meaningless(values)
    with pytest.raises(ValueError, match=key):
        KTOLoss(**values)


def test_sft_datasets_still_read_a_prompt_completion_and_label_as_prompt_response():
    row = {"prompt": "2+2?", "completion": "4", "label": True}
    assert format_of_shape(row, reads=("prompt_response", "messages")) == (
        "prompt_response",
        {"response": "completion"},
    )


def test_an_examples_prompt_is_cut_for_its_own_completion_not_its_kl_rows(tmp_path):
    """A long borrowed completion is cut at its end in the KL row; the example keeps the
    prompt its own completion leaves room for."""
    from freetx.data import ByteTokenizer, UnpairedPreferenceDataset

    rows = tmp_path / "unpaired.jsonl"
    rows.write_text(json.dumps({"prompt": "P" * 20, "completion": "a", "label": True}) + "\n"
                    + json.dumps({"prompt": "Q?", "completion": "b" * 60, "label": False}) + "\n")  # fmt: skip
    data = UnpairedPreferenceDataset(source=str(rows), tokenizer=ByteTokenizer(), seq_len=32,
                                     split="train", val_fraction=0.0, cache=False)  # fmt: skip
    example, kl_row = data[0]
    assert (example["input_ids"] == ord("P")).sum() == 20 and data.fit.prompts_cut == 0
    assert (kl_row["input_ids"] == ord("P")).sum() == 20 and (kl_row["input_ids"] == ord("b")).any()

"""On-policy distillation's pieces: a row's prompt as the data gives it (`TokenBatch.prompts`),
the rows a sample makes (`TokenBatch.of_completions`), TRL's lmbda coin keyed by the step,
and the config values no run can use."""

from __future__ import annotations

import torch

from freetx.data import DistillBatch, RolloutBatch, token_sample
from freetx.data.batch import IGNORE_INDEX
from freetx.objectives.on_policy import OnPolicyConfig, keyed_uniform


def _row(prompt: list[int], answer: list[int], width: int) -> dict[str, torch.Tensor]:
    """A padded data row: prompt then answer, labels on the answer (shifted)."""
    tokens = [*prompt, *answer]
    input_ids = torch.zeros(width, dtype=torch.long)
    labels = torch.full((width,), IGNORE_INDEX, dtype=torch.long)
    input_ids[: len(tokens) - 1] = torch.tensor(tokens[:-1])
    labels[len(prompt) - 1 : len(tokens) - 1] = torch.tensor(answer)
    return token_sample(input_ids, labels, real_tokens=len(tokens) - 1)


def test_a_rows_prompt_is_its_tokens_up_to_its_first_label():
    rows = [_row([5, 6, 7], [8, 9, 2], 8), _row([5], [4, 2], 8)]
    unlabelled = token_sample(torch.tensor([3, 4, 5, 0, 0, 0, 0, 0]),
                              torch.full((8,), IGNORE_INDEX), real_tokens=3)  # fmt: skip
    batch = DistillBatch.collate([*rows, unlabelled])
    assert batch.prompts() == [[5, 6, 7], [5], [3, 4, 5]]


def test_completions_make_rows_whose_labels_are_the_completions_and_whose_prompts_round_trip():
    prompts, completions = [[5, 6, 7], [5]], [[8, 9, 2], [4, 4, 4, 2]]
    batch = DistillBatch.of_completions(prompts, completions)
    assert isinstance(batch, DistillBatch) and batch.input_ids.shape == (2, 5)
    assert batch.prompts() == prompts
    for row, (p, c) in enumerate(zip(prompts, completions)):
        labels = batch.labels[row][batch.labels[row] != IGNORE_INDEX].tolist()
        assert labels == c
        assert batch.input_ids[row, : len(p) + len(c) - 1].tolist() == [*p, *c][:-1]
    assert batch.real_tokens.tolist() == [5, 4]
    # a rollout's rows are the same rows, with their advantages
    rollout = RolloutBatch.of_rollouts(prompts, completions, torch.tensor([1.0, -1.0]))
    assert torch.equal(rollout.labels, batch.labels) and rollout.advantages.tolist() == [1, -1]


def test_the_lmbda_coin_is_keyed_by_the_step_and_lands_on_policy_about_lmbda_of_the_time():
    draws = [keyed_uniform(f"seed 0 step {s} on-policy") for s in range(4000)]
    assert draws == [keyed_uniform(f"seed 0 step {s} on-policy") for s in range(4000)]
    assert all(0 <= u < 1 for u in draws)  # so lmbda 0 never lands on-policy, lmbda 1 always
    for lmbda in (0.25, 0.5, 0.9):
        share = sum(u < lmbda for u in draws) / len(draws)
        assert abs(share - lmbda) < 0.03, (lmbda, share)
    assert draws[:50] != [keyed_uniform(f"seed 1 step {s} on-policy") for s in range(50)]


def test_an_lmbda_outside_zero_to_one_and_a_top_p_outside_its_range_are_meaningless():
    found = OnPolicyConfig.meaningless({"lmbda": 1.5, "top_p": 0})
    assert set(found) == {"lmbda", "top_p"} and "[0, 1]" in found["lmbda"]
    assert OnPolicyConfig.meaningless({"lmbda": 0.5}) == {}
    assert OnPolicyConfig(lmbda=0.0).samples is False
    assert OnPolicyConfig(lmbda=0.0, validate=True).validates is True
    assert OnPolicyConfig(lmbda=0.3).validates is True

"""`freetx.models.generation`: sampling a batch of prompts with the KV cache equals a full
forward per token; a row's reply depends on its own draws, not on the rows beside it;
top-k and top-p keep what they say; the entropy is the sampled distribution's."""

from __future__ import annotations

import math

import pytest
import torch

from freetx.models.generation import Draws, Sampling, generate, sampling_problems
from freetx.models.transformer import decoder

PROMPTS = [[1, 5, 9, 12], [1, 7], [1, 3, 3, 3, 3, 8, 2]]


def lively_decoder() -> torch.nn.Module:
    """The tiny decoder (vocabulary 40, 64 positions), its weights x 3: lively logits,
    tokens that change from step to step."""
    torch.manual_seed(0)
    m = decoder(preset="tiny", vocab_size=40, max_seq_len=64)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0)
    return m.eval()


@pytest.fixture(scope="module")
def model():
    return lively_decoder()


def draws(rows: int, steps: int = 12) -> Draws:
    return Draws.keyed([f"row {i}" for i in range(rows)], steps)


def test_the_kv_cache_gives_the_tokens_a_full_forward_per_token_gives(model):
    sampling = Sampling(temperature=1.0, top_k=20)
    cached = generate(model, PROMPTS, 12, sampling, [], draws(3))
    for i, prompt in enumerate(PROMPTS):  # a full forward has no padding mask: each alone
        mine = Draws(draws(3).uniforms[i : i + 1])
        full = generate(model, [prompt], 12, sampling, [], mine, use_cache=False)
        assert full.tokens[0].tolist() == cached.tokens[i].tolist()
        torch.testing.assert_close(full.entropy[0], cached.entropy[i], atol=1e-3, rtol=1e-3)


def test_prompts_of_different_lengths_without_a_cache_are_refused(model):
    with pytest.raises(ValueError, match="padding mask"):
        generate(model, PROMPTS, 4, Sampling(), [], draws(3), use_cache=False)


def test_a_rows_reply_does_not_depend_on_the_rows_sampled_beside_it(model):
    sampling = Sampling(temperature=1.0)
    together = generate(model, PROMPTS, 12, sampling, [], draws(3))
    for i, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], 12, sampling, [], Draws(draws(3).uniforms[i : i + 1]))
        assert alone.tokens[0].tolist() == together.tokens[i].tolist()


def test_keyed_draws_are_the_same_for_the_same_key_and_differ_between_keys():
    a, b = Draws.keyed(["x", "y"], 5).uniforms, Draws.keyed(["x"], 5).uniforms
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], a[1])


def test_rows_end_at_their_end_token_and_the_batch_stops_when_all_have(model):
    greedy = Sampling(temperature=0)
    free = generate(model, PROMPTS, 12, greedy, [], draws(3))
    end = free.tokens[0, 2].item()  # row 0's third token ends it
    out = generate(model, PROMPTS, 12, greedy, [end], draws(3))
    assert out.lengths[0] == 3 and out.ended[0]
    assert out.replies()[0] == free.tokens[0, :3].tolist()
    for row, n, ended in zip(out.tokens.tolist(), out.lengths.tolist(), out.ended.tolist()):
        assert (end in row[: n - 1]) is False and ended == (row[n - 1] == end)
    assert (out.entropy[0, 3:] == 0).all()  # nothing sampled past its end


def test_greedy_takes_the_most_likely_token():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert Sampling(temperature=0).next_tokens(logits, torch.rand(2)).tolist() == [1, 0]


def test_top_k_keeps_the_k_likeliest_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    probs = Sampling(temperature=1.0, top_k=2).probabilities(logits)[0]
    assert probs[0] == 0 and probs[2] == 0
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)


def test_top_p_keeps_the_smallest_set_of_tokens_reaching_its_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = Sampling(temperature=1.0, top_p=0.8).probabilities(logits)[0]
    # 0.5 alone is short of 0.8; 0.5 + 0.3 reaches it: the rest are gone
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    only = Sampling(temperature=1.0, top_p=0.1).probabilities(logits)[0]
    assert only.tolist() == [1.0, 0.0, 0.0, 0.0]  # the likeliest always stays


def test_inverse_cdf_sampling_draws_each_token_with_its_probability():
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]])).expand(20000, 3)
    uniforms = torch.rand(20000, generator=torch.Generator().manual_seed(1))
    chosen = Sampling(temperature=1.0).next_tokens(logits, uniforms)
    shares = torch.bincount(chosen, minlength=3).float() / 20000
    torch.testing.assert_close(shares, torch.tensor([0.2, 0.5, 0.3]), atol=0.015, rtol=0)


def test_a_top_p_outside_zero_to_one_is_meaningless():
    assert "top_p" in sampling_problems({"top_p": 1.5})
    assert "top_p" in sampling_problems({"top_p": 0})
    assert sampling_problems({"top_p": 1.0}) == {} and sampling_problems({}) == {}

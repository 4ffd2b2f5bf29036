"""Generation with a KV cache (`DecodesIncrementally`): the native decoder's cache
(freetx/models/kv_cache.py) gives the full forward's logits step by step, and greedy
decoding with it, prompts of different lengths left-padded in one batch, gives
transformers' `generate(do_sample=False)` tokens (its own cache, one prompt at a time)
for every kind of attention: plain (Llama), sliding windows and soft-capping (Gemma 2),
LongRoPE past its switch (Phi-3), experts (Qwen3-MoE, Mixtral), and the generic path
(StarCoder2, Phi-2: transformers' own cache)."""

from __future__ import annotations

import pytest
import torch

from tests.hf_folders import make_folder, spread_weights

transformers = pytest.importorskip("transformers")

# prompts of 5, 12 and 9 tokens: left-padded to 12 in one batch
LENGTHS = (5, 12, 9)


def lively_folder(root, family):
    """The family's tiny folder, its weights spread where greedy text would repeat one
    token (Gemma 2's soft-caps keep its own weights lively; larger ones flatten them)."""
    folder = make_folder(root / family, family)
    return folder if family == "gemma2" else spread_weights(folder, root / "spread")


def load(folder):
    from freetx.checkpoint import load_model, resolve_checkpoint

    return load_model(resolve_checkpoint(str(folder)), torch.device("cpu"), seed=0).eval()


def prompts(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=generator) for n in LENGTHS]


@torch.no_grad()
def cached_greedy(model, rows: list[torch.Tensor], steps: int) -> list[list[int]]:
    """Greedy tokens with the model's KV cache, the rows left-padded into one batch."""
    longest = max(len(r) for r in rows)
    padding = torch.tensor([longest - len(r) for r in rows])
    ids = torch.stack(
        [torch.cat([torch.zeros(longest - len(r), dtype=torch.long), r]) for r in rows]
    )
    cache = model.new_cache(padding, longest + steps)
    fresh, out = ids, []
    for _ in range(steps):
        fresh = model(fresh, cache=cache)[:, -1].argmax(-1, keepdim=True)
        out.append(fresh)
    return torch.cat(out, 1).tolist()


# gemma2: a window of 40 and both soft-caps, 12 + 48 tokens; phi3_longrope: short tables
# up to 64 tokens, long ones beyond (transformers computes its cache again there)
@pytest.mark.parametrize(
    "family", ["llama3_2", "gemma2", "phi3_longrope", "qwen3_moe", "mixtral", "starcoder2", "phi"]
)
def test_greedy_with_the_cache_and_padded_prompts_equals_transformers_generate(tmp_path, family):
    folder = lively_folder(tmp_path, family)
    steps = 60 if family == "phi3_longrope" else 48
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    theirs = [
        theirs_model.generate(p[None], do_sample=False, max_new_tokens=steps, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist()
        for p in prompts()
    ]  # fmt: skip
    assert len({token for reply in theirs for token in reply}) > 10  # greedy text that moves
    model = load(folder)
    generic = family in ("starcoder2", "phi")
    assert type(model).__name__ == ("HFGenericModel" if generic else "Transformer")
    assert cached_greedy(model, prompts(), steps) == theirs


@pytest.mark.parametrize("family", ["llama3_2", "gemma2", "phi3_longrope", "qwen3_moe"])
@torch.no_grad()
def test_cached_logits_equal_the_full_forwards_step_by_step(tmp_path, family):
    """A 50-token prompt, then 30 tokens one at a time: each step's logits as the full
    forward over the whole sequence gives them (gemma2: past its window of 40;
    phi3_longrope: across its switch at 64)."""
    model = load(make_folder(tmp_path / family, family))
    ids = torch.randint(3, 300, (2, 80), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(torch.zeros(2, dtype=torch.long), 80)
    steps = [model(ids[:, :50], cache=cache)[:, -1]]
    steps += [model(ids[:, t : t + 1], cache=cache)[:, -1] for t in range(50, 80)]
    for t, logits in zip(range(50, 81), steps):
        assert (logits - model(ids[:, :t])[:, -1]).abs().max() <= 1e-4, t


def test_the_free_transformer_samples_with_a_full_forward():
    from freetx.models import DecodesIncrementally
    from freetx.models.free_transformer import free_transformer
    from freetx.models.transformer import decoder

    with torch.device("meta"):
        assert isinstance(decoder("tiny"), DecodesIncrementally)
        assert not isinstance(free_transformer("tiny"), DecodesIncrementally)

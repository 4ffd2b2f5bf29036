"""The generation engine on every model kind, from tiny folders transformers wrote: the
native decoder (Llama; Gemma 2's window and soft-capping; Qwen3-MoE's experts;
DeepSeek-V3's latent attention) decodes over the paged cache with the static batch's
tokens and logits within 1e-5; the generic path (GPT-2), a hybrid with its own cache
(Qwen3.5) and a LongRoPE model (Phi-3) keep the static batch, the Free Transformer its
full forward per token: `generate` gives each its tokens as before."""

from __future__ import annotations

import pytest
import torch

from freetx.models.engine import EngineConfig
from freetx.models.generation import Draws, Sampling, generate
from freetx.models.kv_cache import KVCache
from freetx.models.paged_cache import BlockPool, PagedRows
from tests.hf_folders import make_folder

pytest.importorskip("transformers")

PAGED = ["llama3_2", "gemma2", "qwen3_moe", "deepseek_v3"]
STATIC_KINDS = ["gpt2", "qwen3_5_text", "phi3_longrope"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from freetx.checkpoint import load_model

    root = tmp_path_factory.mktemp("engine_folders")
    return {f: load_model(make_folder(root / f, f), "cpu").eval() for f in PAGED + STATIC_KINDS}


def rows(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 11, 19)]
    return [p for p in prompts for _ in range(2)]


def logits_paged_vs_dense(model, prompt: list[int], steps: int = 5) -> float:
    """The largest difference of the logits of `prompt` then `steps` tokens through the
    paged cache (blocks of 4) and the dense cache."""
    tokens = torch.tensor([prompt + [7] * steps])
    layers, length = len(model.layers), len(prompt)
    pool, tables = BlockPool(layers, 12, 4), torch.arange(1, 12)[None]
    dense = KVCache(layers, length + steps, torch.zeros(1, dtype=torch.long))
    paged, full = [], []
    with torch.no_grad():
        for t in [0, *range(length, length + steps)]:
            new = tokens[:, t : t + 1] if t else tokens[:, :length]
            paged.append(model(new, cache=PagedRows(pool, tables, torch.tensor([t]))))
            full.append(model(new, cache=dense))
    return (torch.cat(paged, 1) - torch.cat(full, 1)).abs().max().item()


@pytest.mark.parametrize("family", PAGED + STATIC_KINDS)
def test_generate_gives_each_model_kind_the_tokens_of_the_static_batch(models, family):
    model = models[family]
    prompts, sampling = rows(model.config.vocab_size), Sampling(1.0, top_k=50)
    draws = Draws.keyed([f"row {i}" for i in range(len(prompts))], 12)
    engine = generate(model, prompts, 12, sampling, [], draws, engine=EngineConfig(block_size=4))
    static = generate(model, prompts, 12, sampling, [], draws, engine=EngineConfig(paged=False))
    assert (engine.stats is not None) == (family in PAGED)
    assert engine.replies() == static.replies()
    if family in PAGED:
        assert engine.stats.prefills == 3
        assert logits_paged_vs_dense(model, prompts[2]) <= 1e-5


def test_the_free_transformer_keeps_its_full_forward():
    from freetx.models.free_transformer import free_transformer

    torch.manual_seed(0)
    model = free_transformer("tiny", vocab_size=40, max_seq_len=32).eval()
    codes = model.prior_codes(2, 12, torch.Generator().manual_seed(0))
    forward = lambda t: model(t, codes=codes[:, : t.shape[1]])[0]  # noqa: E731
    draws = Draws.keyed(["a", "b"], 8)
    prompts = [[1, 2, 3, 4], [1, 2, 3, 4]]
    out = generate(model, prompts, 8, Sampling(1.0), [], draws, forward=forward)
    assert out.stats is None and out.lengths.tolist() == [8, 8]
    alone = generate(model, prompts[:1], 8, Sampling(1.0), [], Draws(draws.uniforms[:1]),
                     forward=lambda t: model(t, codes=codes[:1, : t.shape[1]])[0])  # fmt: skip
    assert alone.replies()[0] == out.replies()[0]

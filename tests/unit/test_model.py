"""The decoder: shapes, RoPE convention, GQA, init determinism, FLOPs."""

import math

import torch

from freetx.distributed import materialize
from freetx.models import Model
from freetx.models.ad import ad_transformer
from freetx.models.decoder.rope import apply_rope, rope_tables
from freetx.models.free_transformer import free_transformer
from freetx.models.transformer import decoder


def small_model(**kw):
    args = dict(vocab_size=50, hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                ffn_hidden_dim=48, max_seq_len=16)  # fmt: skip
    args.update(kw)
    with torch.device("meta"):
        model = decoder(**args)
    materialize(model, torch.device("cpu"), seed=0)
    return model


def test_forward_shape_and_causality():
    model = small_model().eval()
    x = torch.randint(0, 50, (2, 10))
    logits = model(x)
    assert logits.shape == (2, 10, 50)
    changed = x.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 50
    # positions before the change see the same logits
    assert torch.allclose(model(changed)[:, :6], logits[:, :6], atol=1e-6)
    assert not torch.allclose(model(changed)[:, 6:], logits[:, 6:])


def test_rope_is_rotate_half_with_relative_positions():
    cos, sin = rope_tables(8, 32, 10000.0)
    q = torch.randn(1, 1, 1, 8)
    k = torch.randn(1, 1, 1, 8)
    # the score depends only on the distance between positions
    s1 = (apply_rope(q, cos[3:4], sin[3:4]) * apply_rope(k, cos[1:2], sin[1:2])).sum()
    s2 = (apply_rope(q, cos[12:13], sin[12:13]) * apply_rope(k, cos[10:11], sin[10:11])).sum()
    assert torch.allclose(s1, s2, atol=1e-5)
    # HF Llama convention: first half pairs with second half, frequencies duplicated
    assert torch.equal(cos[:, :4], cos[:, 4:])
    x = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0]).view(1, 1, 1, 8)
    rotated = apply_rope(x, cos[1:2], sin[1:2]).flatten()
    assert math.isclose(rotated[0].item(), math.cos(1.0), abs_tol=1e-6)
    assert math.isclose(rotated[4].item(), math.sin(1.0), abs_tol=1e-6)


def test_init_is_deterministic_and_scaled():
    a, b = small_model(), small_model()
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(a.norm.weight, torch.ones(32))
    std_wo = a.layers[0].attention.wo.weight.std().item()
    std_wq = a.layers[0].attention.wq.weight.std().item()
    assert std_wo < std_wq / 1.5  # residual projections scaled by 1/sqrt(2L)


def test_tied_head_uses_the_embedding():
    model = small_model(tie_embeddings=True)
    assert model.output is None
    names = [n for n, _ in model.named_parameters()]
    assert "tok_embeddings.weight" in names and not any(n.startswith("output") for n in names)


def test_presets_and_flops():
    with torch.device("meta"):
        t, big = decoder("tiny"), decoder("llama3_8b")
    assert 1e6 < t.num_parameters() < 3e6
    assert abs(big.num_parameters() - 8.03e9) < 0.01e9
    # 6N + 12 L H d T at T=8192 for 8B: about 6 * 7.5e9 + 12 * 32 * 4096 * 8192
    expected = 6 * big.num_parameters(exclude_embeddings=True) + 12 * 32 * 4096 * 8192
    assert big.flops_per_token(8192) == expected


def test_a_window_hides_what_lies_beyond_it_in_the_decoder_and_the_ad_transformer():
    """2 layers with a window of 3: position t sees back to t - 4 at most, so changing token 0
    changes positions 0-4 and leaves 5 on alone."""
    with torch.device("meta"):
        ad = ad_transformer(n_transit=16, num_layers=2, sliding_window=3, dropout=0.0)
    materialize(ad, torch.device("cpu"), seed=0)
    decoder_model, ad = small_model(sliding_window=3).eval(), ad.eval()
    runs = {"decoder": decoder_model, "ad": lambda ids: ad(ids, ids, ids)}
    x = torch.randint(0, 2, (2, 12))  # a state, action and reward every AD config has
    changed = x.clone()
    changed[:, 0] = 1 - changed[:, 0]
    for name, run in runs.items():
        with torch.no_grad():
            difference = (run(changed) - run(x)).abs().amax(dim=(0, 2))
        assert (difference[:5] > 1e-6).all() and (difference[5:] == 0).all(), (name, difference)


def test_every_model_follows_the_protocol_and_presets_take_overrides():
    with torch.device("meta"):
        models = [decoder("tiny"), free_transformer("tiny"), ad_transformer(n_transit=40)]
    assert all(isinstance(m, Model) for m in models)
    with torch.device("meta"):
        wide = decoder("tiny", hidden_dim=96, num_heads=4)
    assert (wide.config.hidden_dim, wide.config.num_layers) == (96, 4)  # the rest: the preset's
    import pytest

    with pytest.raises(ValueError, match="has no field 'hiden_dim' \\(did you mean 'hidden_dim'"):
        decoder("tiny", hiden_dim=3)
    with pytest.raises(ValueError, match="unknown preset 'huge'; the presets are: tiny, small"):
        decoder("huge")


def test_a_model_that_misspells_a_hook_is_refused_when_built():
    """A hook under a near-miss name would never be called: refused, naming the hook
    and its protocol, when the model is parallelized (or built from a checkpoint)."""
    import pytest

    from freetx.distributed import (
        DistributedConfig,
        DistributedRuntime,
        ParallelGroups,
        parallelize,
    )
    from freetx.errors import ConfigError
    from freetx.models.protocol import check_model

    class Toy(torch.nn.Module):
        block_types = ()

        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def init_parameter(self, name, tensor, generator) -> None:
            tensor.zero_()

        def init_buffer(self) -> None:  # init_buffers misspelt
            pass

    with torch.device("meta"):
        toy = Toy()
    runtime = DistributedRuntime(0, 0, 1, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"'init_buffer'.*'init_buffers'.*InitBuffers"):
        parallelize(toy, ParallelGroups(runtime), DistributedConfig(), seed=0)
    check_model(small_model())  # every module of the decoder passes

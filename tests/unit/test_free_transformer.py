"""The Free Transformer's pieces: mapper, KL, injection, encoder, prior, loss, data."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from freetx.data import ByteTokenizer, LetterBlockDataset
from freetx.data.letter_block import block_start, letter_block_text
from freetx.distributed import materialize
from freetx.models import OutputLayer
from freetx.models import free_transformer as ft
from freetx.models.free_transformer import (
    FreeTransformerLoss,
    PostSampler,
    binary_mapper,
    bits_to_index,
    code_table,
    free_transformer,
    index_to_bits,
    kl_to_uniform,
    uniform_bits,
)
from freetx.models.transformer import decoder

SHAPE = dict(
    vocab_size=40, hidden_dim=32, num_layers=4, num_heads=4, max_seq_len=16, ffn_hidden_dim=48
)


def build(fn, **kw):
    with torch.device("meta"):
        model = fn(**{**SHAPE, **kw})
    materialize(model, torch.device("cpu"), seed=5)
    return model


def test_mapper_is_exactly_one_hot_and_indexes_the_bits():
    logits = torch.randn(3, 5, 4, requires_grad=True)
    codes, bits = binary_mapper(logits)
    assert torch.equal(codes.detach(), codes.detach().round())  # values are exactly 0 or 1
    assert torch.equal(codes.detach().sum(-1), torch.ones(3, 5))
    assert torch.equal(codes.detach().argmax(-1), bits_to_index(bits))
    assert torch.equal(code_table(4)[bits_to_index(bits)], bits)


def test_code_probabilities_sum_to_one_and_carry_the_gradient():
    logits = torch.randn(2, 3, 3, requires_grad=True)
    codes, _ = binary_mapper(logits)
    weights = torch.randn(8)
    (codes * weights).sum().backward()
    # d/dlogits of sum_c G_c w_c, with G_c = prod_h P(bit_h = bit_h(c)), computed by hand
    table = code_table(3)
    p = torch.sigmoid(logits.detach())
    expected = torch.zeros_like(p)
    for h in range(3):
        for c in range(8):
            g = torch.ones(2, 3)
            for k in range(3):
                g = g * (p[..., k] if table[c, k] else 1 - p[..., k])
            sign = 1.0 if table[c, h] else -1.0
            expected[..., h] += (
                weights[c] * g * sign * (1 - p[..., h] if table[c, h] else p[..., h])
            )
    assert torch.allclose(logits.grad, expected, atol=1e-5)
    g = torch.exp(torch.nn.functional.logsigmoid(logits) @ table.T
                  + torch.nn.functional.logsigmoid(-logits) @ (1 - table).T)  # fmt: skip
    assert torch.allclose(g.sum(-1), torch.ones(2, 3))


@pytest.mark.parametrize("chunk_elements", [2**26, 36])  # all 32 codes at once; 3 at a time
def test_table_lookup_equals_the_one_hot_through_a_linear_layer(monkeypatch, chunk_elements):
    """The post-sampler's index lookup gives what the paper's one-hot over the 2^H codes
    through a linear layer gives: the same R, and the same gradients of z_logits (through
    every code's probability) and of the table: bit for bit in one chunk of codes (the
    same operations), to 1e-6 over chunks (sums in another order)."""
    monkeypatch.setattr(ft, "CHUNK_ELEMENTS", chunk_elements)  # 12 tokens: chunks of 3 codes
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 6, 5, generator=g) * 2
    noise = torch.rand(2, 6, 5, generator=g)
    table = torch.randn(7, 32, generator=g)
    grad_r = torch.randn(2, 6, 7, generator=g)

    z_dense, table_dense = z.clone().requires_grad_(), table.clone().requires_grad_()
    codes, bits = binary_mapper(z_dense, noise)
    r_dense = F.linear(codes, table_dense)
    r_dense.backward(grad_r)

    sampler = PostSampler(5, 7, factored=False)
    sampler.weight.data.copy_(table)
    z_lookup = z.clone().requires_grad_()
    r_lookup = sampler(ft.sample_bits(z_lookup, noise), z_lookup)
    r_lookup.backward(grad_r)

    assert torch.equal(r_lookup, r_dense)  # the forward is bit-identical
    assert z_lookup.grad.abs().max() > 0.1
    assert torch.allclose(z_lookup.grad, z_dense.grad, rtol=0, atol=1e-6)
    assert torch.allclose(sampler.weight.grad, table_dense.grad, rtol=0, atol=1e-6)
    if chunk_elements >= 12 * 32:
        assert torch.equal(z_lookup.grad, z_dense.grad)


def test_the_model_trains_bit_identically_to_the_one_hot_form():
    """Every parameter's gradient of the loss (CE + KL) equals the paper's form's, where
    the post-sampler is a linear layer on binary_mapper's one-hot: the shipped table
    configs' runs and figures do not change."""
    x = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(3))
    noise = torch.rand(2, 12, 4, generator=torch.Generator().manual_seed(4))

    def gradients(one_hot: bool) -> dict[str, torch.Tensor]:
        free = build(free_transformer, latent_dim=4)
        with torch.no_grad():
            free.post_sampler.weight.normal_(generator=torch.Generator().manual_seed(1))
            free.encoder_readout.weight.normal_(generator=torch.Generator().manual_seed(2))
        if one_hot:
            table = free.post_sampler.weight
            free.post_sampler.forward = lambda bits, z: F.linear(binary_mapper(z, noise)[0], table)
        loss, _ = FreeTransformerLoss(kappa_bits=0.0)(free, x, x, noise=noise)
        loss.backward()
        return {name: p.grad for name, p in free.named_parameters()}

    reference, lookup = gradients(one_hot=True), gradients(one_hot=False)
    assert reference["encoder_readout.weight"].abs().max() > 0
    for name, grad in reference.items():
        assert torch.equal(lookup[name], grad), name


def test_uniform_bits_draw_what_an_index_over_the_codes_drew():
    torch.manual_seed(4)  # H <= 62: one randint over the 2^H codes, as before (same stream)
    bits = uniform_bits((3, 5), 8)
    torch.manual_seed(4)
    assert torch.equal(bits, index_to_bits(torch.randint(0, 256, (3, 5)), 8).bool())
    wide = uniform_bits((4096,), 64, generator=torch.Generator().manual_seed(0))
    assert wide.shape == (4096, 64) and wide.dtype == torch.bool
    means = wide.float().mean(0)  # every bit, the second word's two included, is fair
    assert ((means > 0.45) & (means < 0.55)).all()


def test_the_factored_post_sampler_trains_and_samples_at_64_bits():
    free = build(free_transformer, latent_dim=64, factored_post_sampler=True)
    with torch.no_grad():
        free.post_sampler.weight.normal_()
    x = torch.randint(0, 40, (2, 12))
    logits, z_logits = free(x)
    assert z_logits.shape == (2, 12, 64)
    loss, extras = FreeTransformerLoss()(free, x, x)
    loss.backward()
    assert free.encoder_readout.weight.grad.abs().sum() > 0  # through the bits
    assert free.post_sampler.weight.grad.shape == (32, 64)
    g = torch.Generator().manual_seed(0)
    prior = free.prior_codes(2, 12, g)
    posterior = free.posterior_codes(x, g)
    assert prior.shape == posterior.shape == (2, 12, 64)
    a, none = free(x, codes=prior)
    b, _ = free(x, codes=posterior)
    assert none is None and not torch.allclose(a, b)
    assert free(x, mode="prior")[0].shape == logits.shape


@pytest.mark.parametrize("num_bits", [1, 3, 5])
def test_kl_equals_brute_force_over_all_codes(num_bits):
    logits = torch.randn(7, num_bits) * 3
    p = torch.sigmoid(logits)
    brute = torch.zeros(7)
    for bits in itertools.product([0, 1], repeat=num_bits):
        q = torch.ones(7)
        for h, b in enumerate(bits):
            q = q * (p[:, h] if b else 1 - p[:, h])
        brute += q * (torch.log(q) - math.log(2**-num_bits))
    assert torch.allclose(kl_to_uniform(logits), brute, atol=1e-5)
    assert torch.allclose(kl_to_uniform(torch.zeros(2, num_bits)), torch.zeros(2), atol=1e-7)
    assert kl_to_uniform(torch.full((1, num_bits), 40.0)).item() == pytest.approx(
        num_bits * math.log(2)
    )


def test_zero_post_sampler_gives_the_baseline_logits():
    free = build(free_transformer, latent_dim=3)
    base = build(decoder)
    assert torch.count_nonzero(free.post_sampler.weight) == 0
    x = torch.randint(0, 40, (2, 12))
    logits, z_logits = free(x)
    assert torch.allclose(logits, base(x), atol=1e-6)
    assert z_logits.shape == (2, 12, 3)
    prior_logits, none = free(x, mode="prior")
    assert none is None and torch.allclose(prior_logits, base(x), atol=1e-6)


def test_encoder_gives_each_position_its_own_latent():
    free = build(free_transformer, latent_dim=4)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained-like scales (the readout starts near zero)
        for weight in (
            free.encoder_query,
            free.encoder_readout.weight,
            free.encoder.attention.wo.weight,
        ):
            weight.copy_(torch.randn(weight.shape, generator=g))
    _, z_logits = free(torch.randint(0, 40, (1, 12), generator=g))
    differences = (z_logits[0] - z_logits[0, :1]).abs().amax(-1)
    assert (differences[1:] > 1e-4).all()  # the seed code gave exactly 0 here


def test_prior_codes_are_uniform():
    free = build(free_transformer, latent_dim=3)
    seen = []
    free.post_sampler.register_forward_hook(
        lambda m, args, out: seen.append(bits_to_index(args[0]))
    )
    torch.manual_seed(0)
    x = torch.randint(0, 40, (64, 16))
    for _ in range(4):
        free(x, mode="prior")
    counts = torch.bincount(torch.cat(seen).flatten(), minlength=8).float()
    expected = counts.sum() / 8
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 24.3  # 7 degrees of freedom, p = 0.001


def test_fixed_codes_are_used_as_given():
    free = build(free_transformer, latent_dim=2)
    with torch.no_grad():
        free.post_sampler.weight.normal_()
    x = torch.randint(0, 40, (1, 8))
    codes = torch.randint(0, 4, (1, 8))
    a, _ = free(x, codes=index_to_bits(codes, 2))
    b, _ = free(x, codes=index_to_bits(codes, 2))
    c, _ = free(x, codes=index_to_bits((codes + 1) % 4, 2))
    assert torch.equal(a, b) and not torch.allclose(a, c)


def test_loss_adds_free_bits_kl_and_reports_metrics():
    loss_fn = FreeTransformerLoss(kappa_bits=0.5)
    torch.manual_seed(3)
    logits = torch.randn(2, 3, 10)
    labels = torch.tensor([[1, 2, -100], [3, 4, 5]])
    z_logits = torch.randn(2, 3, 4) * 3

    def model(input_ids, output_loss):  # these logits and latents, as a model hands them over
        return output_loss(logits, OutputLayer(lambda h: h, (), 10)), z_logits

    loss, extras = loss_fn(model, labels, labels)
    ce = torch.nn.functional.cross_entropy(logits.view(-1, 10), labels.view(-1), reduction="sum")
    kl = kl_to_uniform(z_logits) * (labels != -100)
    assert torch.allclose(extras["ce"], ce)
    assert torch.allclose(loss, ce + torch.clamp(kl - 0.5 * math.log(2), min=0).sum())
    assert torch.allclose(extras["kl_bits"], kl.sum() / math.log(2))
    assert torch.allclose(extras["honest_nll"], ce + kl.sum())
    assert extras["kl_active"].item() == 5  # the masked position does not count


def test_letter_block_samples():
    text = letter_block_text(seed=0, index=3)
    assert len(text) == 66 and text[1] == ">"
    assert text == letter_block_text(seed=0, index=3) != letter_block_text(seed=1, index=3)
    clean = letter_block_text(seed=0, index=3, noise_probability=0.0)
    start = block_start(clean)
    assert clean[2 + start : 2 + start + 8] == clean[0] * 8 and set(clean[2:]) == {"_", clean[0]}
    data = LetterBlockDataset(ByteTokenizer(), num_samples=100)
    sample = data[7]
    assert sample["input_ids"].shape == (66,) and sample["labels"][0] == -100
    assert ByteTokenizer().decode(sample["labels"][1:].tolist()) == data.text(7)[1:]
    val = LetterBlockDataset(ByteTokenizer(), num_samples=100, split="validation")
    assert len(val) == 10 and val.text(0) != data.text(0)

"""The loss that never makes the logits whole (freetx.models.chunked_loss): chunked
cross-entropy equals the unchunked loss and gradients, for tied and untied heads,
Gemma's final soft-cap, a mixture of experts' aux loss, packed documents and the Free
Transformer; evaluation takes no gradients; the default by vocabulary size; a
mixture's per-source sums."""

from __future__ import annotations

import pytest
import torch

from freetx.data import SourcesOf
from freetx.distributed import materialize
from freetx.models.chunked_loss import ChunkedCrossEntropy, default_num_chunks
from freetx.models.free_transformer import FreeTransformerLoss, free_transformer
from freetx.models.protocol import OutputLayer
from freetx.models.transformer import decoder
from freetx.objectives import CrossEntropyLoss
from freetx.training import per_source_means

SMALL = dict(vocab_size=96, hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_dim=48, max_seq_len=32)  # fmt: skip
VARIANTS = {
    "tied": dict(tie_embeddings=True),
    "untied": dict(tie_embeddings=False),
    "softcap": dict(tie_embeddings=True, final_logit_softcap=3.0),  # Gemma 2's
    "moe": dict(
        num_experts=4, experts_per_token=2, moe_ffn_hidden_dim=24, router_aux_loss_coef=0.05
    ),  # fmt: skip
}


def built(build, **fields):
    with torch.device("meta"):
        model = build(**fields)
    materialize(model, torch.device("cpu"), seed=3)
    return model.train()


def batch(vocab: int = 96):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (3, 20), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[0, :7] = -100  # a prompt
    labels[2, 15:] = -100  # padding
    return ids, labels


def loss_and_grads(model, loss_fn, ids, labels, **inputs):
    model.zero_grad(set_to_none=True)
    loss, extras = loss_fn(model, ids, labels, **inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), extras, grads


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("chunks", [2, 7])
def test_chunked_loss_and_gradients_equal_the_unchunked(variant, chunks):
    model = built(decoder, **SMALL, **VARIANTS[variant])
    ids, labels = batch()
    whole, whole_extras, whole_grads = loss_and_grads(
        model, CrossEntropyLoss(num_chunks=1), ids, labels
    )
    loss, extras, grads = loss_and_grads(model, CrossEntropyLoss(num_chunks=chunks), ids, labels)
    assert abs(loss.item() - whole.item()) <= 1e-5 * abs(whole.item())
    assert whole_grads.keys() == grads.keys() and len(grads) == len(list(model.parameters()))
    for name, grad in grads.items():
        scale = whole_grads[name].abs().max().item() + 1e-12
        assert (grad - whole_grads[name]).abs().max().item() <= 1e-5 * scale, name
    assert extras.keys() == whole_extras.keys()  # the MoE's router metrics alike


def test_chunked_loss_of_a_packed_batch_equals_the_unchunked():
    model = built(decoder, **SMALL)
    ids, labels = batch()
    documents = torch.tensor([[0] * 8 + [1] * 12, [0] * 20, [0] * 5 + [1] * 10 + [-1] * 5])
    whole = loss_and_grads(model, CrossEntropyLoss(num_chunks=1), ids, labels, documents=documents)
    chunked = loss_and_grads(
        model, CrossEntropyLoss(num_chunks=4), ids, labels, documents=documents
    )
    assert torch.allclose(whole[0], chunked[0], rtol=1e-5)
    for name, grad in chunked[2].items():
        assert torch.allclose(grad, whole[2][name], rtol=1e-4, atol=1e-7), name


def test_the_free_transformers_loss_chunks_alike():
    model = built(free_transformer, preset="tiny", num_layers=2, split_layer=1)
    ids, labels = batch(vocab=259)
    noise = torch.rand(3, 20, 8, generator=torch.Generator().manual_seed(4))
    whole = loss_and_grads(model, FreeTransformerLoss(num_chunks=1), ids, labels, noise=noise)
    chunked = loss_and_grads(model, FreeTransformerLoss(num_chunks=5), ids, labels, noise=noise)
    assert torch.allclose(whole[0], chunked[0], rtol=1e-5)
    for key in ("ce", "kl_bits", "honest_nll"):
        assert torch.allclose(whole[1][key], chunked[1][key], rtol=1e-5)
    for name, grad in chunked[2].items():
        assert torch.allclose(grad, whole[2][name], rtol=1e-4, atol=1e-7), name


def test_evaluation_under_no_grad_takes_no_gradients_and_equals_training():
    model = built(decoder, **SMALL).eval()
    ids, labels = batch()
    with torch.no_grad():
        loss, _ = CrossEntropyLoss(num_chunks=3).evaluate(model, ids, labels)
        whole, _ = CrossEntropyLoss(num_chunks=1).evaluate(model, ids, labels)
    assert not loss.requires_grad
    assert torch.allclose(loss, whole, rtol=1e-5)
    assert all(p.grad is None for p in model.parameters())


def test_per_token_losses_are_each_tokens_and_zero_where_ignored():
    hidden = torch.randn(2, 5, 4)
    weight = torch.randn(11, 4)
    labels = torch.tensor([[1, 2, -100, 3, 4], [-100, -100, 5, 6, 7]])
    layer = OutputLayer(lambda h: h @ weight.t(), (weight,), 11)
    for chunks in (1, 3):
        losses = ChunkedCrossEntropy(labels, chunks, per_token=True)(hidden, layer)
        wanted = torch.nn.functional.cross_entropy(
            (hidden @ weight.t()).flatten(0, 1), labels.flatten(), reduction="none"
        ).view(2, 5)
        assert torch.allclose(losses.per_token, wanted, atol=1e-6)
        assert torch.allclose(losses.total, wanted.sum(), atol=1e-5)


def test_each_sources_loss_is_its_tokens_mean():
    per_token = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0], [3.0, 3.0, 3.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    sums = SourcesOf(torch.tensor([0, 1, 0]), ("chat", "code")).sums(per_token, mask)
    assert sums["loss/chat"].item() == 12.0 and sums["loss_tokens/chat"].item() == 5
    assert sums["loss/code"].item() == 4.0 and sums["loss_tokens/code"].item() == 1
    # as a logged step divides every sum by the step's loss tokens (6), then the means
    logged = per_source_means({k: v.item() / 6 for k, v in sums.items()} | {"loss": 16 / 6})
    assert logged == pytest.approx({"loss": 16 / 6, "loss/chat": 12 / 5, "loss/code": 4.0})


def test_the_default_number_of_chunks_follows_the_vocabulary():
    assert default_num_chunks(259) == 1 and default_num_chunks(32_000) == 1
    assert default_num_chunks(128_256) == 8 and default_num_chunks(262_144) == 8
    with pytest.raises(ValueError, match="num_chunks"):
        CrossEntropyLoss(num_chunks=0)


class WholeVocabulary:
    """A `VocabSlice` of one rank: the slice is the whole vocabulary, nothing to reduce."""

    start = 0

    def max(self, x):
        return x

    def sum(self, x):
        return x

    def gather(self, x):
        return x


def test_the_vocabulary_parallel_cross_entropy_is_the_cross_entropy():
    """Its losses and its gradient in the logits (softmax minus one-hot, 0 where ignored)
    against torch's on one slice; several slices: tests/distributed/test_mesh_layouts.py."""
    import torch.nn.functional as F

    from freetx.models.chunked_loss import sliced_cross_entropy

    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 11, generator=generator) * 4).requires_grad_()
    labels = torch.tensor([0, 10, 3, -100, 7, 7])
    losses, grad = sliced_cross_entropy(logits.detach(), labels, -100, WholeVocabulary())
    want = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    want.sum().backward()
    assert torch.allclose(losses, want.detach(), atol=1e-6) and losses[3] == 0
    assert torch.allclose(grad, logits.grad, atol=1e-6)

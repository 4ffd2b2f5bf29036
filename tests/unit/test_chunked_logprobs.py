"""Each token's log-probability without the whole logits (freetx.models.chunked_loss.
ChunkedLogProbs): equal to log_softmax of the whole logits, values and the gradients of
the hidden states and of a trained head for any per-token upstream gradient, in one
chunk, in three, in uneven chunks, with ignored tokens; through a decoder's forward;
under no_grad; over a head sliced by vocabulary (two slices, one thread each); under
FSDP2 and tensor parallelism, 4 processes (slow)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from freetx.distributed import materialize
from freetx.models.chunked_loss import ChunkedLogProbs
from freetx.models.protocol import OutputLayer
from freetx.models.transformer import decoder
from tests.distributed.launcher import run_checks

VOCAB, DIM = 37, 8


def head_and_batch(seed: int = 0, rows: int = 3, length: int = 7):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, length, DIM, generator=g)
    weight = torch.randn(VOCAB, DIM, generator=g)
    labels = torch.randint(0, VOCAB, (rows, length), generator=g)
    labels[0, :3] = -100  # a prompt
    labels[2, 5:] = -100  # padding
    upstream = torch.randn(rows, length, generator=g)  # any gradient of each token's log-prob
    return hidden, weight, labels, upstream


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def picked(logits, labels):
    """The obvious way: the whole logits' log_softmax, the labels' entries gathered."""
    logps = F.log_softmax(logits.float(), dim=-1)
    return logps.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * (labels != -100)


def direct(hidden, weight, labels, upstream):
    hidden, weight = leaves(hidden, weight)
    logps = picked(hidden @ weight.t(), labels)
    (logps * upstream).sum().backward()
    return logps.detach(), hidden.grad, weight.grad


def chunked(hidden, weight, labels, upstream, chunks, vocab=None):
    hidden, weight = leaves(hidden, weight)
    layer = OutputLayer(lambda h: h @ weight.t(), (weight,), VOCAB, vocab)
    logps = ChunkedLogProbs(labels, chunks)(hidden, layer)
    (logps * upstream).sum().backward()
    return logps.detach(), hidden.grad, weight.grad


def assert_close(got, want):
    for a, b, name in zip(got, want, ("log-probs", "hidden's gradient", "head's gradient")):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert (a - b).abs().max().item() <= 1e-5 * (b.abs().max().item() + 1), name


@pytest.mark.parametrize("chunks", [1, 3, 4])  # 21 tokens: 4 chunks are uneven (6, 5, 5, 5)
def test_chunked_log_probs_and_gradients_equal_the_whole_log_softmax(chunks):
    hidden, weight, labels, upstream = head_and_batch()
    got = chunked(hidden, weight, labels, upstream, chunks)
    assert_close(got, direct(hidden, weight, labels, upstream))
    assert (got[0][labels == -100] == 0).all()


def test_ignored_rows_have_zero_log_probs_and_send_no_gradient():
    hidden, weight, labels, upstream = head_and_batch()
    labels[1] = -100
    logps, grad_hidden, _ = chunked(hidden, weight, labels, upstream, 3)
    assert (logps[1] == 0).all() and (grad_hidden[1] == 0).all()
    assert_close(
        chunked(hidden, weight, labels, upstream, 3), direct(hidden, weight, labels, upstream)
    )


def test_under_no_grad_the_log_probs_are_the_same_and_keep_no_graph():
    hidden, weight, labels, _ = head_and_batch()
    layer = OutputLayer(lambda h: h @ weight.t(), (weight.requires_grad_(),), VOCAB)
    with torch.no_grad():
        logps = ChunkedLogProbs(labels, 3)(hidden, layer)
    want = direct(hidden, weight.detach(), labels, torch.zeros(3, 7))[0]
    assert not logps.requires_grad and torch.allclose(logps, want, atol=1e-6)


def test_a_frozen_head_sends_gradients_to_the_hidden_states_only():
    hidden, weight, labels, upstream = head_and_batch()
    hidden.requires_grad_()
    layer = OutputLayer(lambda h: h @ weight.t(), (weight,), VOCAB)  # no parameter trains
    (ChunkedLogProbs(labels, 3)(hidden, layer) * upstream).sum().backward()
    assert weight.grad is None
    assert torch.allclose(hidden.grad, direct(hidden, weight, labels, upstream)[1], atol=1e-5)


def test_a_decoders_forward_returns_the_log_probs_in_place_of_the_logits():
    with torch.device("meta"):
        model = decoder(preset="tiny", num_layers=2)
    materialize(model, torch.device("cpu"), seed=3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 259, (2, 12), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, :4] = -100
    upstream = torch.randn(2, 12, generator=g)

    def grads(logps):
        model.zero_grad(set_to_none=True)
        (logps * upstream).sum().backward()
        return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want, want_grads = grads(picked(model(ids), labels))
    got, got_grads = grads(model(ids, output_loss=ChunkedLogProbs(labels, num_chunks=5)))
    assert got.shape == (2, 12) and torch.allclose(got, want, atol=1e-5)
    for name, grad in got_grads.items():
        scale = want_grads[name].abs().max().item() + 1e-12
        assert (grad - want_grads[name]).abs().max().item() <= 1e-4 * scale, name


class ThreadSlice:
    """A `VocabSlice` of one of two slices, each computed in its own thread: `max` and
    `sum` reduce over both threads through a barrier (tensor parallelism's all-reduce)."""

    def __init__(self, start: int, rank: int, shared: dict, barrier: threading.Barrier):
        self.start, self.rank, self.shared, self.barrier = start, rank, shared, barrier

    def reduce(self, x, op):
        self.shared[self.rank] = x
        self.barrier.wait()
        out = op(self.shared[0], self.shared[1])
        self.barrier.wait()  # both read before either writes again
        return out

    def max(self, x):
        return self.reduce(x, torch.maximum)

    def sum(self, x):
        return self.reduce(x, torch.add)

    def gather(self, x):
        raise NotImplementedError  # the loss never gathers the logits


def test_a_head_sliced_by_vocabulary_gives_the_whole_log_probs_and_gradients():
    hidden, weight, labels, upstream = head_and_batch()
    split = 20  # slices of 20 and 17 entries
    shared, barrier, results = {}, threading.Barrier(2), {}

    def rank(r, start, end):
        piece = weight[start:end]
        results[r] = chunked(
            hidden, piece, labels, upstream, 3, ThreadSlice(start, r, shared, barrier)
        )

    threads = [threading.Thread(target=rank, args=a) for a in [(0, 0, split), (1, split, VOCAB)]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    logps, grad_hidden, grad_weight = direct(hidden, weight, labels, upstream)
    assert torch.allclose(results[0][0], logps, atol=1e-5)
    assert torch.allclose(results[1][0], logps, atol=1e-5)
    # each rank's hidden gradient is its slice's part: tensor parallelism sums them
    assert torch.allclose(results[0][1] + results[1][1], grad_hidden, atol=1e-5)
    assert torch.allclose(results[0][2], grad_weight[:split], atol=1e-5)
    assert torch.allclose(results[1][2], grad_weight[split:], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_under_fsdp_and_tensor_parallelism_the_log_probs_and_gradients_are_one_processs(
    tp, tmp_path
):
    """dp 4 (FSDP2), or dp 2 x tp 2 (an untied head sliced by vocabulary), a DPO loss of the
    rows' log-probs, against one process's whole logits (tests/distributed/logprobs_checks.py)."""
    script = Path(__file__).parents[1] / "distributed" / "logprobs_checks.py"
    for rank in run_checks(script, tmp_path, 4, "--tp", str(tp)):
        for name in ("untied", "tied"):
            assert rank[f"{name}/sliced"] == (tp == 2 and name == "untied")
            assert rank[f"{name}/logps"] <= 1e-5, name
            assert rank[f"{name}/grad"] <= 1e-5 * rank[f"{name}/grad_scale"], name


def test_chunked_log_probs_run_on_fake_tensors():
    """`freetx estimate --measure` runs a step on fake tensors: chunks from sizes alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        hidden, weight, labels, upstream = head_and_batch()
        logps, grad_hidden, grad_weight = chunked(hidden, weight, labels, upstream, 4)
        assert logps.shape == labels.shape and grad_hidden.shape == hidden.shape
        assert grad_weight.shape == weight.shape

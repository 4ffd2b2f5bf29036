"""Issue 36, `freetx estimate --measure` and the audit's weak cases of this part: the
documented llama3_8b line (compile: true, the chunked loss on fake tensors)."""

from __future__ import annotations

import pytest
import torch

from freetx.models.chunked_loss import ChunkedCrossEntropy, chunk_bounds
from tests.conftest import run_freetx_here

# llm/llama3_8b's keys at a tiny shape: its `compile: true`, fsdp, its 8-chunk loss
_SMALL_LLAMA = (
    "model.hidden_dim=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.vocab_size=512", "model.max_seq_len=64", "loss.num_chunks=8", "batch_size=4",
    "gradient_accumulation_steps=1", "dataset.seq_len=32",
)  # fmt: skip


def test_estimate_llama3_8b_measure_with_compile_true_runs():
    result = run_freetx_here(
        "estimate", "llm/llama3_8b", "--world-size", "1", *_SMALL_LLAMA,
        "distributed.activation_checkpointing=selective", "distributed.ac_every_n_blocks=2",
        "--measure",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "measured peak" in result.stdout
    assert "blocks uncompiled" in result.stdout  # the config's compile: true, said


@pytest.mark.slow
def test_estimate_llama3_8b_measure_without_compile_runs():
    result = run_freetx_here(
        "estimate", "llm/llama3_8b", "--world-size", "2", *_SMALL_LLAMA,
        "distributed.compile=false", "--measure",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "measured peak" in result.stdout
    assert "uncompiled" not in result.stdout


def test_chunked_loss_runs_on_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from freetx.models.protocol import OutputLayer

    with FakeTensorMode():
        weight = torch.randn(50, 8, requires_grad=True)
        hidden = torch.randn(2, 7, 8, requires_grad=True)
        labels = torch.randint(0, 50, (2, 7))
        layer = OutputLayer(lambda h: h @ weight.T, [weight], 50, None)
        total, _ = ChunkedCrossEntropy(labels, num_chunks=3)(hidden, layer)
        total.backward()
        assert weight.grad.shape == weight.shape and hidden.grad.shape == hidden.shape


def test_chunk_bounds_are_tensor_splits():
    for n, chunks in [(14, 3), (5, 8), (16, 4), (1, 1)]:
        splits = torch.arange(n).tensor_split(chunks)
        expected = [(int(s[0]), int(s[-1]) + 1) for s in splits if s.numel()]
        assert chunk_bounds(n, chunks) == expected

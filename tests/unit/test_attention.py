"""The decoder's attention kernels (freetx/models/attention.py): which one a device and a
layer's needs pick, and that every kernel computes the same attention (FlexAttention's
forward on CPU included; its backward exists on CUDA only)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from freetx.models.attention import AttentionSpec, attend, choose_kernel, window_mask

WINDOW, CAP, SCALE = AttentionSpec(window=5), AttentionSpec(softcap=2.0), AttentionSpec(scale=0.3)
BOTH = AttentionSpec(window=5, softcap=2.0, scale=0.3)


@pytest.mark.parametrize(
    "device,spec,dropout,kernel",
    [("cpu", AttentionSpec(), 0.0, "sdpa"), ("cuda", AttentionSpec(), 0.0, "sdpa"),
     ("cpu", SCALE, 0.0, "sdpa"), ("cuda", SCALE, 0.1, "sdpa"),
     ("cpu", WINDOW, 0.0, "sdpa_mask"), ("cuda", WINDOW, 0.0, "flex"),
     ("cpu", CAP, 0.0, "explicit"), ("cuda", CAP, 0.0, "flex"),
     ("cpu", BOTH, 0.0, "explicit"), ("cuda", BOTH, 0.0, "flex"),
     # FlexAttention has no dropout: what computes it on the CPU does on CUDA too
     ("cuda", WINDOW, 0.1, "sdpa_mask"), ("cuda", BOTH, 0.1, "explicit")],
)  # fmt: skip
def test_the_kernel_follows_the_device_and_the_layers_needs(device, spec, dropout, kernel):
    assert choose_kernel(device, spec, dropout) == kernel


def test_a_window_is_the_latest_tokens_itself_included_as_transformers_counts():
    """masking_utils.sliding_window_causal_mask_function: kv_idx > q_idx - window."""
    mask = window_mask(8, 3, torch.device("cpu"))
    assert mask.sum(1).tolist() == [1, 2, 3, 3, 3, 3, 3, 3]
    assert mask[5].nonzero().flatten().tolist() == [3, 4, 5]
    assert torch.equal(window_mask(8, None, torch.device("cpu")), torch.ones(8, 8).tril().bool())


def qkv(requires_grad=False):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 16, generator=generator) for h in (4, 2, 2))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def test_the_plain_path_is_sdpa_is_causal_bit_for_bit():
    q, k, v = qkv()
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(attend(q, k, v, AttentionSpec()), expected)


@pytest.mark.parametrize("spec", [WINDOW, CAP, BOTH, SCALE, AttentionSpec()])
def test_every_kernel_computes_the_same_attention(spec):
    q, k, v = qkv()
    reference = attend(q, k, v, spec, kernel="explicit")
    with warnings.catch_warnings():  # eager FlexAttention warns that it is not compiled
        warnings.simplefilter("ignore")
        flex = attend(q, k, v, spec, kernel="flex")
    assert (flex - reference).abs().max() <= 1e-5
    if spec.softcap is None:
        for kernel in ("sdpa", "sdpa_mask") if spec.window is None else ("sdpa_mask",):
            assert (attend(q, k, v, spec, kernel=kernel) - reference).abs().max() <= 1e-5
    if spec.window is not None:  # the window changes the result
        assert (attend(q, k, v, AttentionSpec(), kernel="explicit") - reference).abs().max() > 1e-2


def test_the_masked_sdpa_and_the_explicit_kernel_have_the_same_gradients():
    grads = []
    for kernel in ("sdpa_mask", "explicit"):
        q, k, v = qkv(requires_grad=True)
        attend(q, k, v, WINDOW, kernel=kernel).square().sum().backward()
        grads.append([t.grad for t in (q, k, v)])
    for ours, theirs in zip(*grads):
        assert (ours - theirs).abs().max() <= 1e-5


def test_a_window_needs_causal_attention():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="a sliding window is causal"):
        attend(q, k, v, WINDOW, causal=False)


@pytest.mark.slow  # 25 s of compiling on 2 CPU cores
def test_flex_attention_inside_a_compiled_block_computes_the_same_attention():
    """What `distributed.compile` makes of a block on CUDA: FlexAttention traced into the
    block's graph (here on CPU, the forward)."""
    q, k, v = qkv()
    with torch.no_grad():
        compiled = torch.compile(lambda q, k, v: attend(q, k, v, BOTH, kernel="flex"))(q, k, v)
    assert (compiled - attend(q, k, v, BOTH, kernel="explicit")).abs().max() <= 1e-5


@pytest.mark.parametrize("device,spec", [("cuda", WINDOW), ("cuda", BOTH)])
def test_decoding_takes_a_masked_kernel_on_cuda_too(device, spec):
    """FlexAttention's compiled kernel would be built again at every new key length."""
    assert choose_kernel(device, spec, decoding=True) == (
        "explicit" if spec.softcap else "sdpa_mask"
    )


@pytest.mark.parametrize("spec", [AttentionSpec(), WINDOW, CAP, BOTH])
@pytest.mark.parametrize("kernel", [None, "explicit"])
def test_queries_after_cached_keys_and_behind_padding_attend_as_in_the_full_sequence(spec, kernel):
    """The last 3 queries over all 24 keys (a KV cache's step) are the full attention's
    last 3 rows; 4 padding keys before the 24 (a left-padded row) change nothing, and
    the padding queries' rows stay finite."""
    q, k, v = qkv()
    full = attend(q, k, v, spec, kernel="explicit")
    assert (attend(q[:, :, -3:], k, v, spec, kernel=kernel) - full[:, :, -3:]).abs().max() < 1e-5
    junk = [torch.randn(2, t.shape[1], 4, 16) for t in (q, k, v)]
    padded = [torch.cat([j, t], dim=2) for j, t in zip(junk, (q, k, v))]
    key_valid = torch.arange(28)[None, :].expand(2, 28) >= 4
    out = attend(*padded, spec, kernel=kernel, key_valid=key_valid)
    assert out.isfinite().all()
    assert (out[:, :, 4:] - full).abs().max() < 1e-5

"""The decoder's attention kernels: which one computes a layer's attention, chosen by
device and need (`choose_kernel`), the masks they take, and the one call the decoder
makes (`attend`).

| need | CPU | CUDA |
|---|---|---|
| causal or bidirectional, nothing else | SDPA `is_causal` | SDPA `is_causal` |
| a sliding window | SDPA with a boolean mask | FlexAttention (block mask), compiled |
| logit soft-capping (+ window or not) | explicit: matmul, tanh cap, mask, fp32 softmax | FlexAttention (`score_mod`), compiled |

FlexAttention has no dropout and no backward on CPU (torch 2.13), so attention dropout
picks SDPA-with-mask or the explicit kernel on CUDA too. A window follows transformers'
convention (`masking_utils.sliding_window_causal_mask_function`): query i sees keys
i - window + 1 .. i, `window` keys including its own.

Decoding with a KV cache (`freetx.models.kv_cache`) gives more keys than queries: the
queries are the last ones (query i sits at key position keys - queries + i), and rows
of a batch may start with padding keys nobody sees (`key_valid`). Such a call takes
the masked kernels (SDPA with a boolean mask, or explicit for soft-capping) on CUDA
too: FlexAttention's compiled kernel would be built again for every new key length.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Kernel = Literal["sdpa", "sdpa_mask", "explicit", "flex"]


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention computes beyond softmax(q k^T / sqrt(head_dim)) v."""

    window: int | None = None  # a query sees its `window` latest keys, itself included
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    scale: float | None = None  # of q k^T; None: 1 / sqrt(head_dim)


def choose_kernel(
    device_type: str, spec: AttentionSpec, dropout: float = 0.0, decoding: bool = False
) -> Kernel:
    """The kernel for a layer's attention on a device (`torch.device.type`); `decoding`:
    with a KV cache (more keys than queries, or padding keys)."""
    if spec.window is None and spec.softcap is None:
        return "sdpa"
    if device_type == "cuda" and dropout == 0.0 and not decoding:
        return "flex"
    return "sdpa_mask" if spec.softcap is None else "explicit"


def window_mask(
    length: int,
    window: int | None,
    device: torch.device,
    keys: int | None = None,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """[length, keys] booleans (keys None: `length`), True where a query (row) sees a key
    (column): causal, within `window` (None: no window), the queries being the last
    `length` of the keys. `key_valid` [B, keys] (False: a padding key) gives [B, 1,
    length, keys], where a query sees the valid keys only, and a padding query itself
    (so that no row of the softmax is empty)."""
    keys = length if keys is None else keys
    positions = torch.arange(keys, device=device)
    distance = positions[keys - length :, None] - positions[None, :]
    seen = distance >= 0
    if window is not None:
        seen = seen & (distance < window)
    if key_valid is None:
        return seen
    return (seen & key_valid[:, None, None, :]) | (distance == 0)


@functools.lru_cache(maxsize=32)
def _block_mask(length: int, window: int | None, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(batch, head, q_index, kv_index):
        causal = kv_index <= q_index
        return causal if window is None else causal & (q_index - kv_index < window)

    return create_block_mask(mask_mod, None, None, length, length, device=device)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex(q, k, v, spec: AttentionSpec, causal: bool) -> torch.Tensor:
    """FlexAttention: compiled on CUDA (fused, no T x T scores; inside a compiled block,
    `distributed.compile`, the block's compile takes it in), eager elsewhere (the forward
    only: tests compare it with the other kernels on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    softcap = spec.softcap

    def capped(score, batch, head, q_index, kv_index):
        return softcap * torch.tanh(score / softcap)

    block_mask = _block_mask(q.shape[2], spec.window, str(q.device)) if causal else None
    compiled = q.is_cuda and not torch.compiler.is_compiling()
    call = _compiled_flex() if compiled else flex_attention
    return call(
        q, k, v, score_mod=None if softcap is None else capped, block_mask=block_mask,
        scale=spec.scale, enable_gqa=k.shape[1] != q.shape[1],
    )  # fmt: skip


def explicit(
    q, k, v, spec: AttentionSpec, causal: bool, dropout: float, key_valid=None
) -> torch.Tensor:
    """Attention written out as transformers' eager attention computes it: scores in the
    compute dtype, soft-capped, masked, softmax in float32."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = spec.scale if spec.scale is not None else 1 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if causal:
        seen = window_mask(q.shape[2], spec.window, q.device, k.shape[2], key_valid)
        scores = scores.masked_fill(~seen, float("-inf"))
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    return torch.matmul(weights, v)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    causal: bool = True,
    dropout: float = 0.0,
    kernel: Kernel | None = None,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [B, heads, T, D] over k, v [B, kv_heads, S, D] (grouped when fewer
    heads), S >= T: the queries are the last T keys' (a KV cache's earlier keys before
    them); `key_valid` [B, S]: False for padding keys (a left-padded batch). `kernel`
    None: `choose_kernel`'s for q's device. A window, more keys than queries and padding
    need `causal`."""
    queries, keys = q.shape[2], k.shape[2]
    decoding = keys != queries or key_valid is not None
    if (spec.window is not None or decoding) and not causal:
        raise ValueError(
            "a sliding window is causal, and so are a KV cache's keys and padding keys; "
            "bidirectional attention has none"
        )
    kernel = kernel or choose_kernel(q.device.type, spec, dropout, decoding)
    if kernel == "flex":
        if decoding:
            raise ValueError("FlexAttention here takes as many keys as queries, no padding")
        return flex(q, k, v, spec, causal)
    if kernel == "explicit":
        return explicit(q, k, v, spec, causal, dropout, key_valid)
    mask = None
    if kernel == "sdpa_mask" or (decoding and causal):
        mask = window_mask(queries, spec.window, q.device, keys, key_valid)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal and mask is None, dropout_p=dropout,
        scale=spec.scale, enable_gqa=k.shape[1] != q.shape[1],
    )  # fmt: skip


def sliding_layers(num_layers: int, window: int | None, layer_types: list[str] | None):
    """Per layer, whether it attends within `window`: the layers `layer_types` marks
    sliding_attention (None: every layer), none without a window."""
    if window is None:
        return [False] * num_layers
    if layer_types is None:
        return [True] * num_layers
    return [kind == "sliding_attention" for kind in layer_types]

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

A packed batch (several samples per row, `freetx.data.packing`) says which sample each
position belongs to, `documents` [B, T] (0, 1, 2, ... within a row; -1 on padding): a
query attends only to keys of its own document (causal, within the window where the
layer has one). `document_mask` builds that mask once per forward and layer kind, for
the kernel `choose_kernel` picks: a boolean [B, 1, T, T] mask (SDPA, or the explicit
kernel for soft-capping) on CPU, a FlexAttention block mask on CUDA. Padding positions
see the padding before them and themselves, so no softmax row is empty.

Under context parallelism (`freetx.models.protocol.ShardsContext`) a rank holds some
positions of each sequence (its queries) and attends over the whole sequence's keys and
values, gathered from every rank: `context_mask` says which of them each query sees
(causal at the query's position in the sequence, within the window and the document),
as a boolean [B or 1, 1, queries, T] mask on CPU or a FlexAttention block mask on CUDA.
`document_mask` and `context_mask` both give an `AttentionMask`, the mask and the
kernel that computes it, which `attend` takes (`mask=`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Literal

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
    device_type: str,
    spec: AttentionSpec,
    dropout: float = 0.0,
    decoding: bool = False,
    documents: bool = False,
) -> Kernel:
    """The kernel for a layer's attention on a device (`torch.device.type`); `decoding`:
    with a KV cache (more keys than queries, or padding keys); `documents`: within the
    documents of a packed batch."""
    if spec.window is None and spec.softcap is None and not documents:
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


@dataclass(frozen=True)
class AttentionMask:
    """A training forward's mask for one kind of layer (its `AttentionSpec`), within the
    documents of a packed batch (`document_mask`) or over the whole sequence's keys
    under context parallelism (`context_mask`), or the rows of a paged KV cache
    (`freetx.models.paged_cache.PagedLayer.mask`): the kernel that computes it, and that
    kernel's mask (booleans [B or 1, 1, queries, keys] for SDPA and the explicit kernel,
    a FlexAttention BlockMask for flex); `valid` [B, queries]: False on padding
    positions (None: no padding, the batch is not packed)."""

    kernel: Kernel
    mask: Any
    valid: torch.Tensor | None


def document_mask(
    documents: torch.Tensor, spec: AttentionSpec, dropout: float = 0.0, kernel: Kernel | None = None
) -> AttentionMask:
    """The mask of a layer whose queries see, causally and within `spec.window`, the keys
    of their own document (`documents` [B, T], -1 on padding); `kernel` None:
    `choose_kernel`'s for the device."""
    kernel = kernel or choose_kernel(documents.device.type, spec, dropout, documents=True)
    if kernel == "sdpa":
        raise ValueError("plain SDPA (is_causal) cannot keep attention within documents")
    if kernel == "flex":
        mask = _document_block_mask(documents, spec.window)
    else:
        seen = window_mask(documents.shape[1], spec.window, documents.device)
        mask = (seen & (documents[:, :, None] == documents[:, None, :]))[:, None]
    return AttentionMask(kernel, mask, documents >= 0)


def context_mask(
    positions: torch.Tensor,
    length: int,
    spec: AttentionSpec,
    documents: torch.Tensor | None = None,
    dropout: float = 0.0,
    kernel: Kernel | None = None,
) -> AttentionMask:
    """The mask of a layer whose queries sit at `positions` [Q] of a `length`-token
    sequence (a context-parallel rank's) and whose keys are the whole sequence: a query
    sees the keys at or before its position, within `spec.window`, and, in a packed batch
    (`documents` [B, length], -1 on padding), of its own document. `kernel` None:
    `choose_kernel`'s for the device (a window or documents' kernel; plain causal
    attention takes the masked one, since its queries are not the last keys)."""
    device = positions.device
    kernel = kernel or choose_kernel(device.type, spec, dropout, documents=True)
    if kernel == "sdpa":
        raise ValueError("plain SDPA (is_causal) cannot place queries inside the sequence")
    valid = None if documents is None else documents[:, positions] >= 0
    if kernel == "flex":
        return AttentionMask(
            kernel, _context_block_mask(positions, length, spec.window, documents), valid
        )
    distance = positions[:, None] - torch.arange(length, device=device)[None, :]
    seen = distance >= 0
    if spec.window is not None:
        seen = seen & (distance < spec.window)
    if documents is not None:
        seen = seen & (documents[:, positions, None] == documents[:, None, :])
    return AttentionMask(kernel, seen[:, None] if documents is not None else seen, valid)


def _context_block_mask(
    positions: torch.Tensor, length: int, window: int | None, documents: torch.Tensor | None
):
    """FlexAttention's block mask for queries at `positions` over a `length`-token
    sequence's keys (built every forward: it follows the documents and the rank)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(batch, head, q_index, kv_index):
        at = positions[q_index]
        seen = kv_index <= at
        if documents is not None:
            seen = seen & (documents[batch, at] == documents[batch, kv_index])
        return seen if window is None else seen & (at - kv_index < window)

    rows = None if documents is None else documents.shape[0]
    return create_block_mask(
        mask_mod, rows, None, positions.numel(), length, device=str(positions.device)
    )


def _document_block_mask(documents: torch.Tensor, window: int | None):
    """FlexAttention's block mask for one batch's documents (built for every batch: the
    mask follows the documents, not only the length)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(batch, head, q_index, kv_index):
        seen = (kv_index <= q_index) & (documents[batch, q_index] == documents[batch, kv_index])
        return seen if window is None else seen & (q_index - kv_index < window)

    length = documents.shape[1]
    return create_block_mask(
        mask_mod, documents.shape[0], None, length, length, device=str(documents.device)
    )


def document_positions(documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position of `documents` [B, T] (each document's positions contiguous), its
    position within its document (RoPE restarts at 0 per document) and its document's
    length (longrope picks its tables by it), each [B, T] int64. Padding (-1) counts as
    one more document."""
    batch, length = documents.shape
    index = torch.arange(length, device=documents.device).expand(batch, length)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    positions = index - torch.where(starts, index, 0).cummax(dim=1).values
    slot = documents + 1  # padding (-1) -> 0
    lengths = torch.zeros(batch, length + 1, dtype=torch.long, device=documents.device)
    lengths = lengths.scatter_reduce(1, slot, positions + 1, "amax")
    return positions, lengths.gather(1, slot)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex(q, k, v, spec: AttentionSpec, causal: bool, block_mask=None) -> torch.Tensor:
    """FlexAttention: compiled on CUDA (fused, no T x T scores; inside a compiled block,
    `distributed.compile`, the block's compile takes it in), eager elsewhere (the forward
    only: tests compare it with the other kernels on CPU). `block_mask`: a packed batch's
    (`document_mask`); None: causal within the window (or none, not `causal`)."""
    from torch.nn.attention.flex_attention import flex_attention

    softcap = spec.softcap

    def capped(score, batch, head, q_index, kv_index):
        return softcap * torch.tanh(score / softcap)

    if block_mask is None and causal:
        block_mask = _block_mask(q.shape[2], spec.window, str(q.device))
    compiled = q.is_cuda and not torch.compiler.is_compiling()
    call = _compiled_flex() if compiled else flex_attention
    return call(
        q,
        k,
        v,
        score_mod=None if softcap is None else capped,
        block_mask=block_mask,
        scale=spec.scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )


def explicit(q, k, v, spec: AttentionSpec, dropout: float, mask=None) -> torch.Tensor:
    """Attention written out as transformers' eager attention computes it: scores in the
    compute dtype, soft-capped, masked (`mask`: True where a query sees a key; None:
    every key), softmax in float32."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = spec.scale if spec.scale is not None else 1 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
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
    mask: AttentionMask | None = None,
) -> torch.Tensor:
    """Attention of q [B, heads, T, D] over k, v [B, kv_heads, S, D] (grouped when fewer
    heads), S >= T: the queries are the last T keys' (a KV cache's earlier keys before
    them); `key_valid` [B, S]: False for padding keys (a left-padded batch). `kernel`
    None: `choose_kernel`'s for q's device. `mask`: a training forward's mask for this
    layer (`document_mask`, `context_mask`; its kernel computes it, and it says where
    the queries are). A window, more keys than queries, padding and masks need `causal`."""
    queries, keys = q.shape[2], k.shape[2]
    decoding = (keys != queries or key_valid is not None) and mask is None
    if (spec.window is not None or decoding or mask is not None) and not causal:
        raise ValueError(
            "a sliding window is causal, and so are a KV cache's keys, padding keys, "
            "packed documents and a context-parallel rank's queries; bidirectional "
            "attention has none"
        )
    if mask is not None and (key_valid is not None):
        raise ValueError("a training mask (documents, context) takes no KV cache")
    if mask is not None:
        kernel = mask.kernel
    kernel = kernel or choose_kernel(q.device.type, spec, dropout, decoding)
    if kernel == "flex":
        if decoding:
            raise ValueError("FlexAttention here takes as many keys as queries, no padding")
        return flex(q, k, v, spec, causal, None if mask is None else mask.mask)
    boolean = None
    if mask is not None:
        boolean = mask.mask
    elif causal and (kernel != "sdpa" or decoding):
        boolean = window_mask(queries, spec.window, q.device, keys, key_valid)
    if kernel == "explicit":
        return explicit(q, k, v, spec, dropout, boolean)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=boolean,
        is_causal=causal and boolean is None,
        dropout_p=dropout,
        scale=spec.scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )


def sliding_layers(num_layers: int, window: int | None, layer_types: list[str] | None):
    """Per layer, whether it attends within `window`: the layers `layer_types` marks
    sliding_attention (None: every layer), none without a window."""
    if window is None:
        return [False] * num_layers
    if layer_types is None:
        return [True] * num_layers
    return [kind == "sliding_attention" for kind in layer_types]

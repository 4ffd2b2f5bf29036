"""The native decoder's KV cache: every layer's keys and values of a batch of rows,
kept between calls so that generating a token runs the model on that token alone
(`freetx.models.protocol.DecodesIncrementally`).

Rows may be left-padded (prompts of different lengths in one batch): `left_padding[b]`
keys at the start of row b are padding, which no query sees, and row b's positions
(RoPE) count from its first real token, as transformers counts them from an attention
mask (`position_ids = attention_mask.cumsum(-1) - 1`). The cache also keeps the token
ids it has seen, so that a model can read them again (LongRoPE's switch to its long
tables, `freetx.models.transformer.Transformer`).
"""

from __future__ import annotations

import torch

from freetx.models.attention import AttentionSpec, attend


class LayerCache:
    """One layer's keys and values [B, kv_heads, max_len, head_dim], written in place;
    made at their first write, in its shape and dtype (under tensor parallelism this
    rank's slice of the heads; the compute dtype under autocast or mixed precision)."""

    def __init__(self, owner: KVCache) -> None:
        self.owner = owner
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor):
        """The new keys and values [B, kv_heads, T, D] stored after the cached ones; returns
        every key and value so far and which keys are real (None: no padding)."""
        if self.keys is None or self.values is None:
            rows, heads, _, dim = k.shape
            shape = (rows, heads, self.owner.max_len, dim)
            self.keys = k.new_zeros(shape)
            self.values = v.new_zeros(shape[:3] + (v.shape[3],))
        start, end = self.owner.length, self.owner.length + k.shape[2]
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end], self.owner.key_valid(end)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec):
        """The new keys and values [B, kv_heads, T, D] cached (`extend`); the queries [B,
        heads, T, D] attend over every real key of their row."""
        k, v, key_valid = self.extend(k, v)
        return attend(q, k, v, spec, causal=True, key_valid=key_valid)


class CachedRows:
    """What every KV cache knows of its rows: `len(left_padding)` rows of up to `max_len`
    tokens each (padding included), `length` of them cached, and the ids seen."""

    def __init__(self, max_len: int, left_padding: torch.Tensor) -> None:
        self.left_padding = left_padding
        self.padded = bool((left_padding > 0).any())
        self.max_len, self.length = max_len, 0
        self.ids = torch.zeros(
            len(left_padding), max_len, dtype=torch.long, device=left_padding.device
        )

    def positions(self, new: int) -> torch.Tensor:
        """[B, new]: the positions of the next `new` tokens, counted from each row's first
        real token (padding at position 0, which nothing sees)."""
        if self.length + new > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} tokens; {self.length + new} asked")
        index = torch.arange(self.length, self.length + new, device=self.ids.device)
        return (index[None, :] - self.left_padding[:, None]).clamp(min=0)

    def lengths(self) -> torch.Tensor:
        """[B]: the tokens each row has cached, its padding aside."""
        return (self.length - self.left_padding).clamp(min=0)

    def key_valid(self, keys: int) -> torch.Tensor | None:
        """[B, keys]: False where a key is padding; None when no row is padded."""
        if not self.padded:
            return None
        index = torch.arange(keys, device=self.ids.device)
        return index[None, :] >= self.left_padding[:, None]

    def advance(self, ids: torch.Tensor) -> None:
        """After a forward over `ids` [B, T]: they are cached."""
        end = self.length + ids.shape[1]
        self.ids[:, self.length : end] = ids
        self.length = end

    def rewind(self) -> torch.Tensor:
        """Forget every cached key (to compute them again); returns the ids seen so far."""
        ids, self.length = self.ids[:, : self.length].clone(), 0
        return ids


class KVCache(CachedRows):
    """The native decoder's cache: each layer's keys and values (`layers`)."""

    def __init__(self, layers: int, max_len: int, left_padding: torch.Tensor) -> None:
        super().__init__(max_len, left_padding)
        self.layers = [LayerCache(self) for _ in range(layers)]

"""Generation with a KV cache for the decoder (`DecodesIncrementally`): `new_cache`
makes the cache (`freetx.models.kv_cache`) that `forward(input_ids, cache=cache)` reads
and extends, so each generated token costs a forward over itself."""

from __future__ import annotations

import torch

from freetx.errors import ConfigError
from freetx.models.decoder.core import DecoderCore
from freetx.models.kv_cache import KVCache


class IncrementalDecoding(DecoderCore):
    """A decoder that generates from a KV cache (`DecodesIncrementally`)."""

    def new_cache(self, left_padding: torch.Tensor, max_len: int) -> KVCache:
        """An empty KV cache (`DecodesIncrementally`) for len(left_padding) rows of up to
        `max_len` tokens, row b starting with left_padding[b] padding tokens."""
        c = self.config
        if max_len > c.max_seq_len:
            raise ConfigError(
                f"generating up to {max_len} tokens (the longest prompt and max_new_tokens) "
                f"goes past the model's max_seq_len={c.max_seq_len}, the positions it has "
                "RoPE tables for. Lower max_new_tokens or shorten the prompts."
            )
        return KVCache(c.num_layers, max_len, left_padding)

"""Generation with a KV cache for the decoder: `new_cache` makes the dense cache of a
static batch (`freetx.models.kv_cache`, `DecodesIncrementally`), and the generation
engine's paged cache (`freetx.models.paged_cache`, `DecodesInBlocks`) needs the number of
layers and the context length; `forward(input_ids, cache=cache)` reads and extends
either, so each generated token costs a forward over itself."""

from __future__ import annotations

import torch

from freetx.models.decoder.core import DecoderCore
from freetx.models.engine import check_context
from freetx.models.kv_cache import KVCache


class IncrementalDecoding(DecoderCore):
    """A decoder that generates from a KV cache: dense (`DecodesIncrementally`) or paged
    (`DecodesInBlocks`)."""

    def block_cache_layers(self) -> int | None:
        """The layers a paged cache holds (`DecodesInBlocks`); None with LongRoPE's switch
        to long tables, which computes every cached key again (`rope.rereads`)."""
        long_after = self.rope.long_after
        if long_after is not None and long_after < self.config.max_seq_len:
            return None
        return self.config.num_layers

    def context_length(self) -> int:
        return self.config.max_seq_len

    def new_cache(self, left_padding: torch.Tensor, max_len: int) -> KVCache:
        """An empty KV cache (`DecodesIncrementally`) for len(left_padding) rows of up to
        `max_len` tokens, row b starting with left_padding[b] padding tokens."""
        check_context(max_len, self.config.max_seq_len)
        return KVCache(self.config.num_layers, max_len, left_padding)

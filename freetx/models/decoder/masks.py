"""The attention masks of the decoder's training forwards: a packed batch's documents
(`DocumentMasks`: `PacksDocuments`) and this rank's part of each sequence under context
parallelism (`ContextMasks`: `ShardsContext`). Each is built once per kind of layer (full,
sliding) and forward (`layer_masks`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from freetx.models.attention import AttentionMask, AttentionSpec, context_mask, document_mask
from freetx.models.decoder.core import DecoderCore
from freetx.models.decoder.layers import HeldElsewhere
from freetx.models.protocol import SequenceShard


def layer_masks(
    model: DecoderCore, build: Callable[[AttentionSpec, float], AttentionMask]
) -> list[AttentionMask | None]:
    """Per layer of `model`, `build(spec, dropout)`, once per kind of layer (None for a
    block another pipeline stage holds)."""
    built: dict[AttentionSpec, AttentionMask] = {}
    masks = []
    for layer in model.layers:
        if isinstance(layer, HeldElsewhere):  # another pipeline stage's block
            masks.append(None)
            continue
        attention = layer.attention
        dropout = attention.attention_dropout if model.training else 0.0
        if attention.spec not in built:
            built[attention.spec] = build(attention.spec, dropout)
        masks.append(built[attention.spec])
    return masks


class DocumentMasks(DecoderCore):
    """A decoder that trains on packed batches (`PacksDocuments`): `forward(input_ids,
    documents=documents)` computes each document as if it were alone."""

    def attention_masks(self, documents: torch.Tensor) -> list[AttentionMask]:
        """Per layer, its mask for a packed batch's `documents` [B, T]: built once per kind
        of layer (full, sliding) and forward (`PacksDocuments`)."""
        return layer_masks(self, lambda spec, dropout: document_mask(documents, spec, dropout))


class ContextMasks(DecoderCore):
    """A decoder that computes this rank's part of each sequence under context parallelism
    (`ShardsContext`): `forward(input_ids, context=shard)`."""

    def context_masks(
        self, context: SequenceShard, documents: torch.Tensor | None, length: int
    ) -> list[AttentionMask]:
        """Per layer, the mask of this rank's queries (`context.indices(length)`) over the
        whole sequence's keys, within `documents` [B, length] where the batch is packed:
        built once per kind of layer and forward (`ShardsContext`)."""
        mine = context.indices(length, self.rope.cos.device)  # the model's device
        return layer_masks(
            self, lambda spec, dropout: context_mask(mine, length, spec, documents, dropout)
        )

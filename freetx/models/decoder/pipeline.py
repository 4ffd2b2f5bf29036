"""Pipeline parallelism for the decoder (`SplitsIntoStages`): a model keeps the blocks of
this rank's stages (`keep_blocks`; the others become `HeldElsewhere`, so names stay),
says which tensors another stage holds (`held_elsewhere`), computes one stage
(`forward_stage`), and keeps counting the whole model's parameters for the banner and MFU."""

from __future__ import annotations

import torch

from freetx.errors import ConfigError
from freetx.models.decoder.core import DecoderCore
from freetx.models.decoder.layers import HeldElsewhere
from freetx.models.moe import Routing, combine_routings, empty_routing
from freetx.models.protocol import OutputLoss, SequenceShard

# the parameter counts `keep_blocks` keeps of the whole model: num_parameters' arguments
# (exclude_embeddings, active)
COUNT_KINDS = tuple((e, a) for e in (False, True) for a in (False, True))


class PipelineStages(DecoderCore):
    """A decoder split into pipeline stages of consecutive blocks (`SplitsIntoStages`)."""

    whole_counts: dict[tuple[bool, bool], int] | None = None  # once split: the whole model's

    def keep_blocks(self, blocks: list[int], first: bool, last: bool) -> None:
        """Pipeline parallelism (`SplitsIntoStages`): keep blocks `blocks` (this rank's
        stages'; every other one becomes a `HeldElsewhere`, so the kept ones keep their
        names), the embedding if this rank holds the first stage, the final norm and the
        head if it holds the last. The whole model's parameter counts are kept for the
        banner and MFU. Refuses a tied embedding the first and last stage would share."""
        c = self.config
        if c.tie_embeddings and not (first and last):
            raise ConfigError(
                "distributed.pp: this model ties its head to its embedding (tie_embeddings), "
                "and pipeline parallelism puts the embedding on the first stage and the head "
                "on the last.",
                fix="Set model.tie_embeddings=false (a separate head, initialized like the "
                "embedding), or set distributed.pp=1.",
            )
        self.whole_counts = {kind: self.num_parameters(*kind) for kind in COUNT_KINDS}
        for i in range(len(self.layers)):
            if i not in blocks:
                self.layers[i] = HeldElsewhere()
        if not first:
            self.tok_embeddings = None
        if not last:
            self.norm = self.output = None

    def held_elsewhere(self, name: str) -> bool:
        """Whether the whole model's tensor `name` is another pipeline stage's (a file or
        checkpoint holds it, this stage does not: `keep_blocks`)."""
        if self.whole_counts is None:  # not split
            return False
        head, _, rest = name.partition(".")
        if head == "layers":
            return isinstance(self.layers[int(rest.split(".")[0])], HeldElsewhere)
        return head in ("tok_embeddings", "norm", "output") and getattr(self, head) is None

    def num_parameters(self, exclude_embeddings: bool = False, active: bool = False) -> int:
        """The whole model's parameters, also where this stage holds part of it."""
        if self.whole_counts is None:
            return super().num_parameters(exclude_embeddings, active)
        return self.whole_counts[(exclude_embeddings, active)]

    def forward_stage(
        self,
        x: torch.Tensor,
        routing: torch.Tensor | None = None,
        *,
        blocks: range,
        documents: torch.Tensor | None = None,
        output_loss: OutputLoss | None = None,
        context: SequenceShard | None = None,
    ):
        """One pipeline stage (`SplitsIntoStages`): blocks `blocks` (this model holds them:
        `keep_blocks`) from `x`, the input ids at the first stage and the hidden states
        [B, T, hidden] after; `routing`: an MoE model's router statistics of the blocks
        before (`Routing.packed`). Returns the hidden states (and the statistics so far,
        for an MoE model) to the next stage; the last stage returns what `forward` would
        (through `output_loss`, with the router loss from every stage's statistics)."""
        first, last = blocks.start == 0, blocks.stop == self.config.num_layers
        inputs = self.block_inputs(x, None, documents, context)
        so_far = None if routing is None else Routing.unpacked(routing)
        h, routing_here = self.run_blocks(self.embed(x) if first else x, blocks, inputs)
        combined = combine_routings([r for r in (so_far, routing_here) if r is not None])
        if not last:
            moe = self.config.num_experts > 0
            if not moe:
                return h
            if combined is None:
                return h, empty_routing(self.config.num_experts, h)
            return h, combined.packed()
        return self.with_router_loss(self.finish(h, output_loss), combined, context)

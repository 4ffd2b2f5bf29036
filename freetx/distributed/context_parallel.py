"""Context parallelism: each sequence split over the `cp` ranks of a (dp, cp, tp) mesh.

A rank holds `seq_len / cp` tokens of every sequence of its data-parallel group's batch
and computes their forward and backward; the attention of its queries runs over the
whole sequence's keys and values, gathered from the `cp` ranks in every layer (the
scheme Llama 3 was trained with). Gathering, not passing blocks around a ring, lets
every attention a model has work unchanged: sliding windows, soft-capping, the document
masks of packed batches, grouped keys; it costs each layer one all-gather of the keys
and values (kv_heads x head_dim x seq_len each, a fraction heads / kv_heads of the
queries' size) in forward and one reduce-scatter of their gradients in backward.

Causal attention does more work late in a sequence than early, so the sequence is cut
into 2 x cp chunks and rank r holds chunks r and 2 cp - 1 - r: every rank gets the same
amount of attention (load balancing, as Megatron-LM and torchtitan do).

`ContextShard` is what a model sees (`freetx.models.protocol.SequenceShard`) and what a
token batch is split by (`TokenBatch.split`, in `accumulate_gradients` before it counts
loss tokens), so the counts, the losses and the gradients add up over the `dp_cp` axis.
"""

from __future__ import annotations

import torch

from freetx.distributed.groups import ParallelGroups
from freetx.models.protocol import ShardsContext, require_hook


def balanced_indices(length: int, size: int, rank: int, device=None) -> torch.Tensor:
    """The positions of a `length`-token sequence that rank `rank` of `size` holds:
    chunks rank and 2 size - 1 - rank of 2 size equal chunks, in order."""
    chunk = length // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, last])


def check_shards_context(model) -> None:
    """distributed.cp > 1 needs a model that computes a part of each sequence as the whole
    sequence would (`ShardsContext`): the model built (`parallelize`, for every recipe) or
    the class a config builds (`check_layout`, before launching)."""
    require_hook(
        model,
        ShardsContext,
        "cannot compute a part of a sequence: its forward takes the whole sequence (the Free "
        "Transformer's encoder reads all of it; a crosscoder or the AD model has no sequence to "
        "split; the generic transformers path has no context-parallel attention), so "
        "distributed.cp > 1 cannot run it.",
        fix="Set distributed.cp=1, or train a native freetx decoder (freetx.models.decoder, "
        "or freetx.models.hf_model on a family freetx reads natively).",
    )


class _GatherRanks(torch.autograd.Function):
    """Every cp rank's tensor, stacked [cp, *shape]; backward: each rank's part of the
    gradient, summed over the ranks (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
        ctx.groups = groups
        return groups.all_gather(x, over="cp")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.groups.reduce_scatter(grad, over="cp"), None


class _SumRanks(torch.autograd.Function):
    """`x` summed over the cp ranks; backward: the gradient summed over them too (every
    rank's loss reads the sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
        ctx.groups = groups
        return groups.all_reduce(x.clone(), over="cp")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.groups.all_reduce(grad.clone(), over="cp"), None


class ContextShard:
    """This rank's part of every sequence (`SequenceShard`): the positions it holds, and
    the collectives over the cp ranks a model's forward needs."""

    def __init__(self, groups: ParallelGroups) -> None:
        self.groups = groups
        self.size = groups.size("cp")
        self.rank = groups.rank("cp")

    def indices(self, length: int, device=None) -> torch.Tensor:
        """The positions of a `length`-token sequence this rank holds (load balanced)."""
        return balanced_indices(length, self.size, self.rank, device)

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of `x` along its sequence dimension `dim`."""
        return x.index_select(dim, self.indices(x.shape[dim], x.device))

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence from every rank's part `x` along `dim`, in order."""
        length = x.shape[dim] * self.size
        stacked = _GatherRanks.apply(x, self.groups)  # [cp, ...] in rank order
        joined = stacked.movedim(0, dim).flatten(dim, dim + 1)
        held = torch.cat([balanced_indices(length, self.size, r) for r in range(self.size)])
        return joined.index_select(dim, held.argsort().to(x.device))

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the cp ranks, differentiably."""
        return _SumRanks.apply(x, self.groups)

    def check_length(self, length: int) -> None:
        """A sequence of `length` tokens splits into this shard's chunks (2 x cp)."""
        self.groups.shape.check_sequence_length(length)

"""Packing: several samples per sequence of seq_len, each attending only to itself.

A sample of n tokens (cut to seq_len + 1, as `fixed_length_sample` cuts it) takes n - 1
positions of a pack: its tokens but the last as inputs, the next token as labels where
that token is a target, so that no label crosses into the next sample. `pack_lengths`
places samples into packs first-fit-decreasing (longest first, ties in an order the
seed fixes; each into the first pack with room), then orders the packs by the seed.
`packed_sample` builds one pack: {"input_ids", "labels", "documents", "real_tokens"},
`documents` [seq_len] the index of the sample each position belongs to within the
pack (0, 1, 2, ...), -1 on the padding at the end. The model restarts positions and
keeps attention within each document (`freetx.models.PacksDocuments`).

Packing is greedy: a pack is full when no remaining sample fits in its room, so the
padding left is at most the shortest sample's length per pack.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from freetx.data.batch import IGNORE_INDEX, token_sample
from freetx.data.token_rows import Encoded


@runtime_checkable
class PacksSamples(Protocol):
    """A dataset that may serve packed samples (`packed`: each sample carries
    `documents`, and the model must take them)."""

    packed: bool


def packs(dataset: object) -> bool:
    """Whether a dataset serves packed samples (`PacksSamples` with `packed` set)."""
    return isinstance(dataset, PacksSamples) and dataset.packed


@dataclass(frozen=True)
class DataSummary:
    """What a split is made of, as sequences: how many samples (documents, for a token
    stream) went into how many sequences of seq_len, and how much of them is padding."""

    samples: int
    sequences: int
    seq_len: int
    real_positions: int  # over all sequences, the positions that are not padding
    packed: bool
    unit: str = "samples"
    # packed: the positions the two shortest samples take (why packing packed nothing)
    two_shortest: tuple[int, int] | None = None
    sequences_per_sample: int = 1  # a preference pair: 2 (its chosen and rejected rows)

    @property
    def padding(self) -> float:
        return 1 - self.real_positions / max(self.sequences * self.seq_len, 1)

    def lines(self) -> list[str]:
        """The summary line, and when packing packed nothing, why and what to change."""
        how = "packed" if self.packed else "not packed"
        lines = [
            f"data: {self.samples:,} {self.unit} -> {self.sequences:,} sequences of "
            f"{self.seq_len} tokens, {self.padding:.1%} padding ({how})"
        ]
        unpacked = self.samples * self.sequences_per_sample
        if self.packed and self.two_shortest and self.sequences == unpacked:
            a, b = self.two_shortest
            wider = 1 << (a + b - 1).bit_length()  # a power of 2 that holds the two shortest
            lines.append(
                f"data: packing packed nothing: no two {self.unit} fit in {self.seq_len} positions "
                f"together (the two shortest take {a} + {b}); raise dataset.seq_len (e.g. "
                f"dataset.seq_len={max(wider, 2 * self.seq_len)}, with model.max_seq_len at "
                "least that) to put several samples in a sequence"
            )
        return lines


@runtime_checkable
class SummarizesData(Protocol):
    """A dataset that says what it is made of (`DataSummary`): `freetx data show` and
    the start-up line of a run."""

    def summary(self) -> DataSummary: ...


def positions_taken(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """The positions each sample of `lengths` tokens takes in a pack: its tokens cut to
    seq_len + 1, less the last (which is only a label)."""
    return np.minimum(lengths, seq_len + 1) - 1


def pack_lengths(lengths: np.ndarray, seq_len: int, seed: int) -> list[list[int]]:
    """Packs of sample indices, each pack's samples taking at most seq_len positions
    (`positions_taken`): first-fit-decreasing, ties and the order of packs fixed by the
    seed. A segment tree over the packs' free room finds the first pack with room in
    O(log packs)."""
    sizes = positions_taken(np.asarray(lengths, dtype=np.int64), seq_len)
    generator = np.random.default_rng(seed)
    tie_order = generator.permutation(len(sizes))
    order = tie_order[np.argsort(-sizes[tie_order], kind="stable")]
    leaves = 1
    while leaves < max(len(sizes), 1):
        leaves *= 2
    room = [seq_len] * (2 * leaves)  # the most free room of a pack under each node
    packs: list[list[int]] = []
    for index, size in zip(order.tolist(), sizes[order].tolist()):
        node = 1
        while node < leaves:  # the leftmost pack with room for `size`
            node = 2 * node if room[2 * node] >= size else 2 * node + 1
        pack = node - leaves
        if pack == len(packs):
            packs.append([])
        packs[pack].append(index)
        room[node] -= size
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return [packs[i] for i in generator.permutation(len(packs)).tolist()]


def packed_sample(samples: Sequence[Encoded], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One pack of `samples` (together at most seq_len positions, `pack_lengths`):
    input_ids, labels and documents [seq_len], and real_tokens (the positions that are
    not padding), padded with pad_id (labels IGNORE_INDEX, documents -1)."""
    inputs: list[int] = []
    labels: list[int] = []
    documents: list[int] = []
    for document, (ids, is_target) in enumerate(samples):
        ids = ids[: seq_len + 1]
        inputs += ids[:-1]
        labels += [t if target else IGNORE_INDEX for t, target in zip(ids[1:], is_target[1:])]
        documents += [document] * (len(ids) - 1)
    real = len(inputs)
    if real > seq_len:
        raise ValueError(f"a pack of {real} positions does not fit seq_len={seq_len}")
    pad = seq_len - real
    return token_sample(
        torch.tensor(inputs + [pad_id] * pad, dtype=torch.long),
        torch.tensor(labels + [IGNORE_INDEX] * pad, dtype=torch.long),
        torch.tensor(documents + [-1] * pad, dtype=torch.long),
        real_tokens=real,
    )


def stream_documents(input_ids: torch.Tensor, labels: torch.Tensor, eos_id: int):
    """A window of a token stream whose documents each end with EOS: `documents` (a new
    one after each EOS among the inputs) and the labels with EOS's next token ignored
    (it is the next document's first), so that no label crosses a boundary."""
    ends = (input_ids == eos_id).long()
    documents = ends.cumsum(0) - ends
    return documents, labels.masked_fill(ends.bool(), IGNORE_INDEX)

"""Tokenized samples stored back to back: the form every token dataset keeps its data in.

A sample is its token ids and, for each token, whether it is a target (a response's or
an assistant's token; every token of a text document). `TokenRows` keeps all samples of
a split in three flat arrays, so that they can live in memory or in memory-mapped files
alike (numpy arrays of either kind):

    ids      [total tokens]   uint32
    targets  [total tokens]   bool
    offsets  [samples + 1]    int64: sample i is ids[offsets[i]:offsets[i + 1]]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Encoded = tuple[list[int], list[bool]]  # token ids, and whether each is a target


class TokenRows:
    """Samples of token ids and target flags, back to back (see the module docstring)."""

    def __init__(self, ids: np.ndarray, targets: np.ndarray, offsets: np.ndarray) -> None:
        self.ids, self.targets, self.offsets = ids, targets, offsets

    @classmethod
    def from_encoded(cls, encoded: Sequence[Encoded]) -> TokenRows:
        lengths = np.array([len(ids) for ids, _ in encoded], dtype=np.int64)
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.fromiter((t for ids, _ in encoded for t in ids), np.uint32, int(offsets[-1]))
        targets = np.fromiter((t for _, ts in encoded for t in ts), np.bool_, int(offsets[-1]))
        return cls(ids, targets, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> Encoded:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.ids[start:end].tolist(), self.targets[start:end].tolist()

    @property
    def lengths(self) -> np.ndarray:
        """Each sample's number of tokens."""
        return np.diff(self.offsets)

    def select(self, indices: Sequence[int]) -> TokenRows:
        """The samples at `indices`, in that order (a copy in memory)."""
        return TokenRows.from_encoded([self[i] for i in indices])

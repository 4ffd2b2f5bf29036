"""Tokenized samples stored back to back: the form every token dataset keeps its data in.

A sample is its token ids and, for each token, whether it is a target (a response's or
an assistant's token; every token of a text document). `TokenRows` keeps all samples of
a split in three flat arrays, so that they can live in memory or in memory-mapped files
alike (numpy arrays of either kind; `freetx.data.token_cache` maps them from disk):

    ids      [total tokens]   uint32 (uint16 in a cache whose vocabulary fits)
    targets  [total tokens]   bool (text: every token, a read-only broadcast of True that
                              holds no memory: `all_targets`)
    offsets  [samples + 1]    int64: sample i is ids[offsets[i]:offsets[i + 1]]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

Encoded = tuple[list[int], list[bool]]  # token ids, and whether each is a target
NO_TARGET = np.iinfo(np.int64).max  # first_targets of a sample without a target


def all_targets(count: int) -> np.ndarray:
    """`count` True flags that take no memory (a read-only broadcast view)."""
    return np.broadcast_to(np.True_, (count,))


def ids_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class TokenRows:
    """Samples of token ids and target flags, back to back (see the module docstring)."""

    def __init__(
        self,
        ids: np.ndarray,
        targets: np.ndarray,
        offsets: np.ndarray,
        first_targets: np.ndarray | None = None,
    ) -> None:
        self.ids, self.targets, self.offsets = ids, targets, offsets
        self._first_targets = first_targets

    @classmethod
    def from_encoded(cls, encoded: Iterable[Encoded], dtype=np.uint32) -> TokenRows:
        builder = RowsBuilder(dtype)
        for sample in encoded:
            builder.add(*sample)
        return builder.rows()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> Encoded:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.ids[start:end].tolist(), self.targets[start:end].tolist()

    @property
    def lengths(self) -> np.ndarray:
        """Each sample's number of tokens."""
        return np.diff(self.offsets)

    @property
    def first_targets(self) -> np.ndarray:
        """Each sample's first target position after its first token (which is never a
        label), NO_TARGET where it has none: a sample keeps a loss token once cut to
        seq_len + 1 tokens iff this is at most seq_len. Computed once (a cache stores it)
        in pieces of about 16M tokens, so a memory-mapped split is never held whole."""
        if self._first_targets is None:
            self._first_targets = self._find_first_targets()
        return self._first_targets

    def _find_first_targets(self) -> np.ndarray:
        starts, ends = self.offsets[:-1], self.offsets[1:]
        found = np.full(len(self), NO_TARGET, dtype=np.int64)
        first = 0
        while first < len(self):
            # rows [first, last) whose tokens span at most 2**24 (at least one row)
            last = max(first + 1, int(np.searchsorted(starts, starts[first] + (1 << 24), "right")))
            base = int(starts[first])
            flags = np.array(self.targets[base : int(ends[last - 1])], dtype=np.bool_)
            row_starts, row_ends = starts[first:last] - base, ends[first:last] - base
            flags[row_starts[row_starts < row_ends]] = False  # a first token is no label
            positions = np.flatnonzero(flags)
            if len(positions):
                nearest = positions[
                    np.minimum(np.searchsorted(positions, row_starts), len(positions) - 1)
                ]
                inside = (nearest >= row_starts) & (nearest < row_ends)
                found[first:last][inside] = (nearest - row_starts)[inside]
            first = last
        return found

    def select(self, indices: Sequence[int]) -> TokenRows:
        """The samples at `indices`, in that order (a copy in memory)."""
        indices = np.asarray(indices, dtype=np.int64)
        lengths = self.lengths[indices]
        offsets = np.zeros(len(indices) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # each selected token's position in the source arrays
        within = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], lengths)
        positions = np.repeat(self.offsets[:-1][indices], lengths) + within
        return TokenRows(
            self.ids[positions],
            np.asarray(self.targets[positions]),
            offsets,
            self.first_targets[indices],
        )


class RowsBuilder:
    """TokenRows made one sample at a time; `flush` hands full pieces of ids and targets to
    a writer (a cache's files) so that a split larger than memory is never held whole."""

    PIECE = 1 << 22  # tokens kept before a flush

    def __init__(self, dtype=np.uint32, write=None, with_targets: bool = True) -> None:
        self.dtype, self.write, self.with_targets = np.dtype(dtype), write, with_targets
        self.ids: list[np.ndarray] = []
        self.targets: list[np.ndarray] = []
        self.lengths: list[int] = []
        self.pending = 0

    def add(self, ids: Sequence[int], targets: Sequence[bool] | None = None) -> None:
        self.ids.append(np.asarray(ids, dtype=self.dtype))
        if self.with_targets:
            self.targets.append(np.asarray(targets, dtype=np.bool_))
        self.lengths.append(len(ids))
        self.pending += len(ids)
        if self.write is not None and self.pending >= self.PIECE:
            self.flush()

    def _joined(self) -> tuple[np.ndarray, np.ndarray | None]:
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, self.dtype)
        targets = None
        if self.with_targets:
            targets = np.concatenate(self.targets) if self.targets else np.zeros(0, np.bool_)
        self.ids, self.targets, self.pending = [], [], 0
        return ids, targets

    def flush(self) -> None:
        self.write(*self._joined())

    def offsets(self) -> np.ndarray:
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(np.asarray(self.lengths, dtype=np.int64), out=offsets[1:])
        return offsets

    def rows(self) -> TokenRows:
        """Everything added, in memory."""
        ids, targets = self._joined()
        return TokenRows(ids, all_targets(len(ids)) if targets is None else targets, self.offsets())

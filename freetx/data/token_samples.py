"""Token samples as the recipes read them: each sample cut to seq_len and padded.

Chat and instruction datasets encode their examples into `TokenRows` (ids, and which
tokens are targets) and serve them through `TokenSamples`: a sample is
{"input_ids", "labels"}, each [seq_len], labels IGNORE_INDEX where a token is not a
target and on the padding. Samples whose targets all lie past seq_len are dropped and
counted (`fit`, see `freetx.data.seq_len`).

`packed=True` serves packs instead (`freetx.data.packing`): several samples per
sequence, placed by the seed, each sample's positions marked in `documents`; the
dataset's length is then the number of packs.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from freetx.data.packing import DataSummary, pack_lengths, packed_sample, positions_taken
from freetx.data.seq_len import fit_to_seq_len, fixed_length_sample
from freetx.data.token_rows import TokenRows


class TokenSamples(Dataset):
    """One split's encoded samples, served at seq_len (see the module docstring)."""

    def __init__(
        self,
        rows: TokenRows,
        seq_len: int,
        pad_id: int,
        split: str,
        source: str,
        packed: bool = False,
        seed: int = 0,
    ):
        kept, self.fit = fit_to_seq_len(rows, seq_len, split, source)
        self.rows = rows if len(kept) == len(rows) else rows.select(kept)
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.packed = packed
        self.packs = pack_lengths(self.rows.lengths, seq_len, seed) if packed else None

    def __len__(self) -> int:
        return len(self.rows) if self.packs is None else len(self.packs)

    def summary(self) -> DataSummary:
        """Samples -> sequences (`freetx.data.SummarizesData`)."""
        taken = positions_taken(self.rows.lengths, self.seq_len)
        two = tuple(int(n) for n in np.sort(taken)[:2]) if len(taken) > 1 else None
        return DataSummary(
            len(self.rows),
            len(self),
            self.seq_len,
            int(taken.sum()),
            self.packed,
            two_shortest=two,
        )

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.packs is None:
            return fixed_length_sample(self.rows[index], self.seq_len, self.pad_id)
        samples = [self.rows[i] for i in self.packs[index]]
        return packed_sample(samples, self.seq_len, self.pad_id)

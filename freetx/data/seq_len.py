"""Samples cut to `seq_len`: how many were cut, how many lost every loss token.

A prompt/response or chat sample is its token ids and, for each token, whether it is
a target (the response's or the assistant's). Cut to `seq_len + 1` tokens, a sample
whose targets all lie past the cut has no loss tokens: it is dropped (axolotl drops
such samples too; torchtune keeps them and trains on nothing). `fit_to_seq_len` counts
both and refuses a split left with no loss tokens at all; the recipe prints
`SeqLenFit.line()` on rank 0 when anything was cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from freetx.data.batch import IGNORE_INDEX, token_sample
from freetx.data.token_rows import NO_TARGET, Encoded, TokenRows
from freetx.errors import DataError


@dataclass(frozen=True)
class SeqLenFit:
    """What cutting a split's samples to seq_len did."""

    split: str
    source: str
    seq_len: int
    samples: int  # before dropping
    cut: int  # longer than seq_len + 1 tokens (their tail is not trained on)
    dropped: int  # of those, left with no loss tokens

    def line(self) -> str:
        return (
            f"dataset {self.source} ({self.split}): {self.cut} of {self.samples} samples cut at "
            f"seq_len={self.seq_len}, {self.dropped} left with no loss tokens (dropped)"
        )


@runtime_checkable
class CutsToSeqLen(Protocol):
    """A dataset whose samples are cut to seq_len; `fit` says what that did."""

    fit: SeqLenFit


def fit_to_seq_len(
    rows: TokenRows, seq_len: int, split: str, source: str
) -> tuple[np.ndarray, SeqLenFit]:
    """The indices of the samples that keep a loss token within seq_len, and the counts
    (from each sample's length and first target: a cached split's tokens are not read).

    Raises DataError when none does: the split would train (or validate) on nothing.
    """
    kept = np.flatnonzero(rows.first_targets <= seq_len)
    cut = int((rows.lengths > seq_len + 1).sum())
    fit = SeqLenFit(split, source, seq_len, len(rows), cut, len(rows) - len(kept))
    if not len(kept):
        earliest = _earliest_target(rows)
        where = (
            f"the earliest response starts at token {earliest}"
            if earliest is not None
            else "no sample has a target token at all"
        )
        raise DataError(
            f"the {split} split of {source} has no loss tokens: in all {len(rows)} samples "
            f"the response (or assistant turn) lies past dataset.seq_len={seq_len} tokens "
            f"({where}), so there is nothing to train or validate on. Raise dataset.seq_len "
            "(and model.max_seq_len with it), shorten the prompts, or check that the chat "
            "template marks the assistant's replies."
        )
    return kept, fit


def _earliest_target(rows: TokenRows) -> int | None:
    """The smallest position of a target after a sample's first token (None: no targets)."""
    earliest = int(rows.first_targets.min(initial=NO_TARGET))
    return None if earliest == NO_TARGET else earliest


def fixed_length_sample(encoded: Encoded, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """{"input_ids", "labels"}, each [seq_len]: the tokens cut to seq_len + 1 and padded
    with pad_id; labels the next token where it is a target, IGNORE_INDEX elsewhere; and
    "real_tokens", the positions that are not padding."""
    ids, is_target = encoded
    ids = ids[: seq_len + 1]
    real = len(ids) - 1
    targets = [t if target else IGNORE_INDEX for t, target in zip(ids, is_target)]
    pad = seq_len + 1 - len(ids)
    ids = ids + [pad_id] * pad
    targets += [IGNORE_INDEX] * pad
    return token_sample(
        torch.tensor(ids[:-1], dtype=torch.long),
        torch.tensor(targets[1:], dtype=torch.long),
        real_tokens=real,
    )

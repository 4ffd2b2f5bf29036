"""A mixture of datasets: several sources in one training set, in the proportions of weights.

    dataset:
      _component_: freetx.data.Mixture
      weights: [3, 1]
      names: [chat, text]
      sources:
        - {_component_: freetx.data.ChatDataset, source: data/chat.jsonl, seq_len: 2048}
        - {_component_: freetx.data.PackedTextDataset, source: data/text, seq_len: 2048}

The sources are built by the mixture (`freetx.fields.BuildsParts`: `instantiate` gives
it one factory per node), each with the tokenizer and split the recipe passed to the
mixture.

Training split: the mixture has `num_samples` samples (default: the sum of the sources'
training lengths). Source i gets round(weights[i] / sum(weights) * num_samples) of them
(largest remainder, so that they add up; weights default to the sources' lengths: the
plain concatenation). Its samples are a seeded permutation of its indices, a new one
for each pass when it is upsampled, cut where its count ends: a function of (seed, i,
pass) alone, so the mixture's samples depend on the seed, the weights and the sources,
never on the world size (the sampler's order is a function of its seed and the global
step: a run resumes at another world size as an unmixed one does).

Validation split: every source's validation split whole, one after the other (no
weights), so each source's validation loss is over all of its split.

Every sample is its source's sample plus `source` (an int64 tensor: the source's index
in `source_names`), for the recipe's per-source losses.
"""

from __future__ import annotations

import math
import numbers
import os
from collections import Counter
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import Dataset

from freetx.data.batch import SOURCE
from freetx.data.packing import SummarizesData, packs
from freetx.errors import ConfigError
from freetx.fields import ReadsFiles

SPLITS = ("train", "validation")


@runtime_checkable
class MadeOfParts(Protocol):
    """A dataset made of other datasets (`parts`), each of which reports its own start-up
    lines (token cache, seq_len cuts, bad rows); `line()` says how it mixes them."""

    parts: list[Any]

    def line(self) -> str: ...


def summary_lines(dataset: object) -> list[str]:
    """What a split is made of (`SummarizesData`): samples -> sequences, padding, and why
    packing packed nothing when it did; a mixture's for each source, by name. Empty for a
    dataset that does not say."""
    if isinstance(dataset, Mixture):
        return [
            f"{name}: {line}"
            for name, part in zip(dataset.source_names, dataset.parts)
            for line in summary_lines(part)
        ]
    return dataset.summary().lines() if isinstance(dataset, SummarizesData) else []


WEIGHT_FIX = (
    "a weight is a positive number (the source's share is its weight over their sum). Make "
    "it positive, or remove the source from dataset.sources."
)


class Mixture(Dataset):
    """Several datasets as one, in proportions set by `weights` (see the module docstring).

    Attributes: `parts` (the built sources), `source_names` (unique; `names`, else each
    source's file stem or folder name, else its class name), `split`, `seq_len` and
    `packed` (the sources', which must agree), `lengths` (each source's samples in this
    split), `counts` (how many of the mixture's samples each source gives), `weights`,
    `files_read` (every file the sources read, for the resume check).
    """

    built_later = ("sources",)  # freetx.fields.BuildsParts: factories, called here

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """Weights no mixture has, by key: why, and the fix (checked by `freetx validate`
        and every run before anything is built; `_check_arguments` when one is)."""
        for i, w in enumerate(values.get("weights") or []):
            if (
                isinstance(w, bool)
                or not isinstance(w, numbers.Real)
                or not (math.isfinite(w) and w > 0)
            ):
                return {"weights": f"weights[{i}] is {w!r}; {WEIGHT_FIX}"}
        return {}

    def __init__(
        self,
        tokenizer,
        sources: list,  # factories: source(tokenizer=..., split=...) builds one dataset
        weights: list[float] | None = None,  # default: the sources' lengths (concatenation)
        split: str = "train",
        seed: int = 0,  # of the sources' permutations
        names: list[str] | None = None,  # for the logs (loss/<name>); default from the sources
        num_samples: int | None = None,  # of the training split; default: the sources' sum
    ) -> None:
        _check_arguments(sources, weights, split, names, num_samples)  # before any work
        self.split, self.seed = split, seed
        self.parts = [factory(tokenizer=tokenizer, split=split) for factory in sources]
        for i, part in enumerate(self.parts):
            if isinstance(part, Mixture):
                raise ConfigError(
                    f"dataset.sources[{i}] is a Mixture itself; list its sources in the outer "
                    "mixture instead (with weights that multiply out to the same shares)."
                )
        self.source_names = list(names) if names is not None else _default_names(self.parts)
        names = self.source_names
        self.seq_len = _agreed(names, [part.seq_len for part in self.parts], "seq_len")
        self.packed = _agreed(names, [packs(part) for part in self.parts], "packed")
        _check_keys(self.parts, self.source_names)
        self.files_read = list(
            dict.fromkeys(Path(f) for part in self.parts for f in _files_read(part))
        )
        self.lengths = [len(part) for part in self.parts]
        if split == "validation":  # every source's split whole: its loss over all of it
            self.weights = [float(n) for n in self.lengths]
            self.counts = list(self.lengths)
            self._draws = None
        else:
            given = list(weights) if weights is not None else self.lengths
            self.weights = [float(w) for w in given]
            total = sum(self.lengths) if num_samples is None else int(num_samples)
            self.counts = _shares(given, total)
            for name, count, weight in zip(self.source_names, self.counts, self.weights):
                if count == 0:
                    raise ConfigError(
                        f"the mixture's source {name!r} gets none of its {total:,} training "
                        f"samples: its weight is {weight:g} of {sum(self.weights):g}, a share "
                        "below one sample.",
                        fix="Raise its weight or dataset.num_samples, or leave it out.",
                    )
            draws = [
                _draws(length, count, seed, i)
                for i, (length, count) in enumerate(zip(self.lengths, self.counts))
            ]
            self._draws = np.concatenate(draws)
        self._starts = np.cumsum([0, *self.counts])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a mixture of {len(self)} samples")
        source = int(np.searchsorted(self._starts, index, side="right")) - 1
        local = index - int(self._starts[source]) if self._draws is None else self._draws[index]
        return {**self.parts[source][int(local)], SOURCE: torch.tensor(source)}

    def line(self) -> str:
        """One line for the start-up: each source's share, and how many passes over its
        split that makes (train)."""
        total = max(len(self), 1)
        shares = []
        for name, count, length in zip(self.source_names, self.counts, self.lengths):
            if self.split == "validation":
                shares.append(f"{name} {count:,}")
            else:
                shares.append(
                    f"{name} {count:,} ({count / total:.1%}; {count / length:.2f} passes over "
                    f"its {length:,})"
                )
        return f"dataset mixture ({self.split}): {len(self):,} samples: " + ", ".join(shares)


def _check_arguments(sources, weights, split, names, num_samples) -> None:
    """The mistakes a config can make in a mixture, each one paragraph, before any source
    is built."""
    if not isinstance(sources, (list, tuple)):
        raise ConfigError(
            f"dataset.sources must be a list of dataset nodes, got {type(sources).__name__}.",
            fix="Write it as a YAML list: `sources:` then one `- _component_: ...` node a source.",
        )
    if not sources:
        raise ConfigError(
            "dataset.sources is empty: a mixture needs at least one source.",
            fix="List the datasets to mix under dataset.sources, each a node with a _component_.",
        )
    for i, source in enumerate(sources):
        if not callable(source):
            raise ConfigError(
                f"dataset.sources[{i}] is {source!r}, not a dataset node.",
                fix="Give each source as a node with a _component_ (a dataset such as "
                "freetx.data.InstructDataset) and its keys.",
            )
    if split not in SPLITS:
        raise ConfigError(f"split must be 'train' or 'validation', got {split!r}.")
    if weights is not None:
        weights = list(weights)
        if len(weights) != len(sources):
            raise ConfigError(
                f"dataset.weights has {len(weights)} value(s) for {len(sources)} source(s).",
                fix="Give one weight per source, in the order of dataset.sources (or leave "
                "weights out to concatenate the sources).",
            )
        for why in Mixture.meaningless({"weights": weights}).values():
            raise ConfigError(f"dataset.{why}")
    if names is not None:
        names = list(names)
        if len(names) != len(sources):
            raise ConfigError(
                f"dataset.names has {len(names)} name(s) for {len(sources)} source(s).",
                fix="Give one name per source, in the order of dataset.sources (or leave names "
                "out: each source is named after its file, or its class).",
            )
        repeated = [n for n, k in Counter(names).items() if k > 1]
        if any(not isinstance(n, str) or not n for n in names) or repeated:
            raise ConfigError(
                f"dataset.names {names!r} must be distinct, non-empty strings"
                + (f" ({repeated[0]!r} is there twice)." if repeated else "."),
                fix="Give each source a name of its own: it labels the source's losses in the "
                "logs (loss/<name>).",
            )
    if num_samples is not None and (
        isinstance(num_samples, bool)
        or not isinstance(num_samples, numbers.Integral)
        or num_samples < 1
    ):
        raise ConfigError(
            f"dataset.num_samples is {num_samples!r}; it is the training split's size, a "
            "positive whole number.",
            fix="Set it to 1 or more, or leave it out (the sum of the sources' lengths).",
        )


def _default_names(parts: list) -> list[str]:
    """Each part's file stem (one file), folder name (several), else class name; unique."""
    names = []
    for part in parts:
        files = [Path(f) for f in _files_read(part)]
        if len(files) == 1:
            names.append(files[0].stem)
        elif files:
            names.append(Path(os.path.commonpath([str(f) for f in files])).name or "files")
        else:
            names.append(type(part).__name__)
    counts, seen, used, unique = Counter(names), Counter(), set(names), []
    for name in names:
        if counts[name] == 1:
            unique.append(name)
            continue
        candidate = name
        while candidate in used:
            seen[name] += 1
            candidate = f"{name}_{seen[name]}"
        used.add(candidate)
        unique.append(candidate)
    return unique


def _files_read(part) -> list:
    """The files a part read (`ReadsFiles`), none for data made in memory."""
    return part.files_read if isinstance(part, ReadsFiles) else []


def _agreed(names: list[str], values: list, attribute: str) -> Any:
    """The value of `attribute` every part has (`values`, in the parts' order); a
    ConfigError naming two that differ."""
    for name, value in zip(names[1:], values[1:]):
        if value != values[0]:
            raise ConfigError(
                f"the mixture's sources {names[0]!r} and {name!r} differ in {attribute}: "
                f"{values[0]!r} and {value!r}; a batch stacks samples of every source, so "
                "they must agree.",
                fix=f"Set the same {attribute} in every node of dataset.sources.",
            )
    return values[0]


def _check_keys(parts: list, names: list[str]) -> None:
    """Every part's samples hold the same keys (its first sample's), which a batch stacks."""
    keys = [sorted(part[0]) for part in parts]
    for name, these in zip(names[1:], keys[1:]):
        if these != keys[0]:
            raise ConfigError(
                f"the mixture's sources {names[0]!r} and {name!r} give samples with different "
                f"keys ({', '.join(keys[0])} and {', '.join(these)}), and a batch stacks "
                "samples of every source.",
                fix="Mix datasets whose samples hold the same keys.",
            )


def _shares(weights: list[float], total: int) -> list[int]:
    """`total` split in proportion to `weights`, by largest remainder (ties: the earlier
    source), exactly (fractions: no rounding decides a tie)."""
    exact = [Fraction(w) for w in weights]
    quotas = [w * total / sum(exact) for w in exact]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _draws(length: int, count: int, seed: int, source: int) -> np.ndarray:
    """`count` indices of a source of `length` samples: a permutation per pass, fixed by
    (seed, source, pass) alone, cut where the count ends."""
    passes = -(-count // length)
    orders = [
        np.random.default_rng([seed % 2**64, source, n]).permutation(length) for n in range(passes)
    ]
    return np.concatenate(orders)[:count].astype(np.int64)

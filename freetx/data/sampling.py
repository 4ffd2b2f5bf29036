"""Which samples each rank reads: a function of the seed and the global step only.

Training: the data is shuffled once per epoch by a permutation that depends
only on (seed, epoch). Optimizer step `b` consumes global batch `b`: the
`global_batch_size` samples at positions [b*G, (b+1)*G) of that order. Rank r
takes its contiguous slice of the global batch and reads it as
`accumulation` micro-batches. The world size only decides who reads what, so a
run resumed at another world size (same global batch) continues with exactly
the samples the uninterrupted run would have seen.

Evaluation: rank r reads samples r, r+W, r+2W, ...; ranks that run out read
padding samples (marked `padding`, for the recipe to leave out), so every rank
runs the same number of forward passes (each may be a collective under FSDP).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from freetx.data.batch import IGNORE_INDEX, PADDING  # noqa: F401 (IGNORE_INDEX: its old home)
from freetx.errors import ConfigError, DataError

# torchdata 0.11 calls a deprecated torch function on every iterator; not ours to fix
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


def micro_batch_size(global_batch_size: int, world_size: int, accumulation: int) -> int:
    """Samples per rank per micro-batch; raises when the split is impossible."""
    parts = world_size * accumulation
    if global_batch_size < parts or global_batch_size % parts:
        raise ConfigError(
            f"batch_size={global_batch_size} (the global batch per optimizer step) cannot be "
            f"split into {world_size} rank(s) x {accumulation} accumulation step(s).",
            fix=f"Use a batch_size that is a multiple of {parts}, or change "
            "gradient_accumulation_steps.",
        )
    return global_batch_size // parts


class GlobalBatchSampler:
    """Yields this rank's micro-batches of indices, forever (epoch after epoch).

    Its state (`global_batch`, `micro`) counts global batches, not this rank's
    batches, so it means the same thing at any world size.
    """

    def __init__(
        self,
        dataset_size: int,
        global_batch_size: int,
        accumulation: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        self.micro_batch = micro_batch_size(global_batch_size, world_size, accumulation)
        if dataset_size < global_batch_size:
            raise DataError(
                f"the training set has {dataset_size} samples, fewer than one global batch "
                f"of {global_batch_size}; lower batch_size or add data."
            )
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.accumulation = accumulation
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.batches_per_epoch = dataset_size // global_batch_size
        self.global_batch = 0
        self.micro = 0
        self._order_epoch = -1
        self._order = torch.arange(0)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._order_epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
                self._order = torch.randperm(self.dataset_size, generator=generator)
            else:
                self._order = torch.arange(self.dataset_size)
            self._order_epoch = epoch
        return self._order

    def indices(self, global_batch: int, micro: int) -> list[int]:
        """The indices this rank reads for micro-batch `micro` of global batch `global_batch`."""
        epoch, offset = divmod(global_batch, self.batches_per_epoch)
        per_rank = self.global_batch_size // self.world_size
        start = offset * self.global_batch_size + self.rank * per_rank + micro * self.micro_batch
        return self._epoch_order(epoch)[start : start + self.micro_batch].tolist()

    def __iter__(self):
        while True:
            batch = self.indices(self.global_batch, self.micro)
            self.micro += 1
            if self.micro == self.accumulation:
                self.global_batch, self.micro = self.global_batch + 1, 0
            yield batch

    @property
    def epoch(self) -> int:
        return self.global_batch // self.batches_per_epoch

    def state_dict(self) -> dict[str, int]:
        return {
            "global_batch": self.global_batch,
            "micro": self.micro,
            "world_size": self.world_size,
            "accumulation": self.accumulation,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        same_split = (state["world_size"], state["accumulation"]) == (
            self.world_size,
            self.accumulation,
        )
        if state["micro"] != 0 and not same_split:
            raise DataError(
                "the data loader's state was saved in the middle of an optimizer step, which "
                "cannot be mapped onto another world size or accumulation; resume with "
                f"{state['world_size']} process(es) and {state['accumulation']} accumulation steps."
            )
        self.global_batch, self.micro = int(state["global_batch"]), int(state["micro"])


class EvalShard(Dataset):
    """Rank r's strided share of an evaluation set, padded to equal length on every rank.

    Every rank gets the same number of samples, so every rank runs the same
    number of forward passes (FSDP2 needs that). Each sample carries `padding`
    (a bool tensor): True for the repeats that fill the last rank's share, which
    the recipe leaves out of its metrics.
    """

    def __init__(self, dataset: Dataset, rank: int, world_size: int) -> None:
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.length = math.ceil(len(dataset) / world_size)

    def __len__(self) -> int:
        return self.length

    def source(self, index: int) -> int:
        """The dataset's index of this shard's sample `index` (the same sample at any
        world size: what keys its draws); len(dataset) or more for a padding repeat."""
        return index * self.world_size + self.rank

    def __getitem__(self, index: int):
        """A sample with `padding`; a preference pair (a tuple of samples): each of them."""
        source = self.source(index)
        repeat = source >= len(self.dataset)
        item, padding = self.dataset[0 if repeat else source], torch.tensor(repeat)
        if isinstance(item, tuple):
            return tuple({**sample, PADDING: padding} for sample in item)
        return {**item, PADDING: padding}


def build_train_loader(
    dataset: Dataset,
    global_batch_size: int,
    accumulation: int,
    rank: int,
    world_size: int,
    seed: int,
    num_workers: int = 0,
    shuffle: bool = True,
    collate: Callable | None = None,
) -> StatefulDataLoader:
    """A StatefulDataLoader over this rank's micro-batches (see GlobalBatchSampler);
    `collate` makes a micro-batch of samples (`TokenBatch.collate`; None: torch's)."""
    sampler = GlobalBatchSampler(
        len(dataset), global_batch_size, accumulation, rank, world_size, seed, shuffle
    )
    # its own generator: creating an iterator must not draw from the global RNG,
    # or a resumed run's dropout masks would shift by one draw
    generator = torch.Generator().manual_seed(seed)
    return StatefulDataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        generator=generator,
        collate_fn=collate,
    )


def build_eval_loader(
    dataset: Dataset,
    global_batch_size: int,
    rank: int,
    world_size: int,
    collate: Callable | None = None,
) -> StatefulDataLoader:
    """Batches of `global_batch_size` samples over all ranks (each rank its strided share):
    global batch i is samples [i B, (i + 1) B) at any world size, so a validation figure
    over the first n batches means the same samples on 1 rank or 8. Every rank gets the
    same number of batches; padding samples are marked `padding`."""
    if global_batch_size % world_size:
        raise ConfigError(
            f"eval.batch_size={global_batch_size} (validation samples per forward pass, over "
            f"all ranks) cannot be split into {world_size} rank(s).",
            fix=f"Use a multiple of {world_size}.",
        )
    generator = torch.Generator().manual_seed(0)  # keeps the global RNG untouched
    return StatefulDataLoader(
        EvalShard(dataset, rank, world_size),
        batch_size=global_batch_size // world_size,
        generator=generator,
        collate_fn=collate,
    )


def check_split(split: str, val_fraction: float, seq_len: int | None = None) -> None:
    """The arguments every dataset with a train/validation split takes, checked."""
    if split not in ("train", "validation"):
        raise DataError(f"split must be 'train' or 'validation', got {split!r}.")
    values = {"val_fraction": val_fraction, "seq_len": seq_len}
    found = split_problems(values)
    if found:
        raise DataError(" ".join(f"dataset.{k}={values[k]!r}: {why}" for k, why in found.items()))


def split_problems(values: dict[str, Any]) -> dict[str, str]:
    """The `val_fraction` and `seq_len` of a dataset with a split that no split has, by
    key: why, and the fix (a dataset's `meaningless`: `freetx validate` and every run
    check a config's dataset nodes with it before anything is built; `check_split`
    when one is)."""
    found = {}
    fraction, seq_len = values.get("val_fraction"), values.get("seq_len")
    if isinstance(fraction, (int, float)) and not 0 <= fraction < 0.5:
        found["val_fraction"] = (
            "it is the share of rows held out for validation; set it in [0, 0.5) (e.g. 0.05; "
            "0: every row trains, and validation is dataset.validation_source or none)."
        )
    if isinstance(seq_len, int) and seq_len < 1:
        found["seq_len"] = "it is the tokens of a training sequence; set 1 or more (e.g. 128)."
    return found


@dataclass(frozen=True)
class Split:
    """Which rows of a source one split takes.

    A row is validation when a seeded hash of its content (`key`: bytes, equal for equal
    content) falls below val_fraction: a function of the row alone, so the split is
    stable as a file grows, independent of row order, and blind to any period in the
    data (every k-th row would put one kind of row in validation when rows cycle over k
    kinds). `whole`: the split reads a source of its own (`validation_source`), all of it.
    """

    name: str  # train | validation
    val_fraction: float
    seed: int = 0
    whole: bool = False

    def takes(self, key: bytes) -> bool:
        return self.whole or in_validation(key, self.seed, self.val_fraction) == (
            self.name == "validation"
        )

    def takes_windows(self, count: int) -> np.ndarray:
        """Which of `count` windows of a token stream this split takes ([count] bools), by
        a seeded hash of each window's index: no reading of the tokens, stable as the
        stream grows at its end, no period (splitmix64's output is uniform per index)."""
        if self.whole:
            return np.ones(count, dtype=bool)
        with np.errstate(over="ignore"):
            x = np.arange(count, dtype=np.uint64) + np.uint64(
                (self.seed * 0x9E3779B97F4A7C15 + 1) % 2**64
            )
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            x = x ^ (x >> np.uint64(31))
        validation = x < np.uint64(int(self.val_fraction * 2**64))
        return validation == (self.name == "validation")


def in_validation(key: bytes, seed: int, val_fraction: float) -> bool:
    """Whether the row with content `key` is validation: blake2b of it, keyed by the seed,
    read as a fraction in [0, 1), is below val_fraction."""
    digest = hashlib.blake2b(key, digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "big") < val_fraction * 2**64


def split_of(
    source, validation_source, split: str, val_fraction: float, seed: int
) -> tuple[Any, Split]:
    """The source a split reads and the rows it takes: with a validation_source, the
    validation split is it, whole, and the training split all of `source`."""
    if validation_source is None:
        return source, Split(split, val_fraction, seed)
    return (validation_source if split == "validation" else source), Split(
        split, val_fraction, seed, whole=True
    )

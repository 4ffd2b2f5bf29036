"""Fleuret's letter-block task: a global decision (where the block goes) to be encoded in Z.

Each sample is the prompt `X>` followed by 64 characters of `_`, with the
letter X repeated 8 times at a random position, and every character (of the
64) replaced by `!` with probability 1/16:

    K>____________________KKKKKKKK____!_________________________!_______

Sample i is a function of (seed, split, i) only, so any rank can make any
sample: the dataset needs no files and shards like any other through the
sampler. Tokens are bytes (ByteTokenizer): input = BOS + the first 65
characters, labels = the next character at each position, with the letter
itself (unpredictable from BOS) ignored. So the model predicts `>` and the 64
body characters.
"""

from __future__ import annotations

import random
import statistics
import string

import torch
from torch.utils.data import Dataset

from freetx.data.batch import IGNORE_INDEX, token_sample
from freetx.data.tokenizers import leading_bos
from freetx.errors import DataError

BODY_LENGTH = 64
BLOCK_LENGTH = 8
NOISE_PROBABILITY = 1 / 16
PROMPT_LENGTH = 2  # "X>"
_SPLIT_OFFSET = {"train": 0, "validation": 1_000_000_007}


def letter_block_text(seed: int, index: int, noise_probability: float = NOISE_PROBABILITY) -> str:
    """The text of sample `index` under `seed`: `X>` + 64 characters."""
    rng = random.Random(seed * 2_147_483_647 + index)
    letter = rng.choice(string.ascii_uppercase)
    start = rng.randrange(BODY_LENGTH - BLOCK_LENGTH + 1)
    body = ["_"] * BODY_LENGTH
    body[start : start + BLOCK_LENGTH] = [letter] * BLOCK_LENGTH
    body = ["!" if rng.random() < noise_probability else c for c in body]
    return f"{letter}>" + "".join(body)


def block_start(text: str) -> int | None:
    """Where the letter's block starts in the body (the first body position holding the
    prompt's letter), or None when the body never shows it."""
    letter, body = text[0], text[PROMPT_LENGTH:]
    position = body.find(letter)
    return None if position < 0 else position


class LetterBlockDataset(Dataset):
    """`num_samples` letter-block sequences of one split, made on demand."""

    def __init__(
        self,
        tokenizer,
        num_samples: int = 100_000,
        split: str = "train",
        seed: int = 0,
        noise_probability: float = NOISE_PROBABILITY,
    ) -> None:
        if split not in _SPLIT_OFFSET:
            raise DataError(f"split must be 'train' or 'validation', got {split!r}.")
        if num_samples < 1:
            raise DataError(f"dataset.num_samples must be positive, got {num_samples}.")
        self.tokenizer = tokenizer
        # validation is a tenth of the training size, from a disjoint index range
        self.num_samples = num_samples if split == "train" else max(1, num_samples // 10)
        self.offset = _SPLIT_OFFSET[split]
        self.seed = seed
        self.noise_probability = noise_probability
        self.seq_len = PROMPT_LENGTH + BODY_LENGTH  # BOS + 65 characters in, 66 labels

    def __len__(self) -> int:
        return self.num_samples

    def text(self, index: int) -> str:
        return letter_block_text(self.seed, self.offset + index, self.noise_probability)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = [*leading_bos(self.tokenizer), *self.tokenizer.encode(self.text(index))]
        tokens = torch.tensor(ids, dtype=torch.long)
        labels = tokens[1:].clone()
        labels[0] = IGNORE_INDEX  # the letter is drawn at random: nothing to learn
        return token_sample(tokens[:-1], labels)


class BlockPositionSpread:
    """A sample measurement for `generate` (`sample_metrics:`): what Z encodes here.

    The standard deviation of the letter block's start position among samples
    that share Z (a group), against the spread over all samples of a prompt. A
    latent that encodes the position gives a small within-group spread.
    """

    def __call__(self, records: list[dict]) -> dict[str, float]:
        starts: dict[tuple[str, int], list[int]] = {}
        for record in records:
            position = block_start(record["prompt"] + record["reply"])
            if position is not None:
                starts.setdefault((record["prompt"], record["group"]), []).append(position)
        within = [statistics.pstdev(v) for v in starts.values() if len(v) > 1]
        prompts = {p for p, _ in starts}
        across = [
            statistics.pstdev([s for (p, _), v in starts.items() if p == prompt for s in v])
            for prompt in prompts
        ]
        return {
            "within_group_std": statistics.mean(within) if within else float("nan"),
            "across_groups_std": statistics.mean(across) if across else float("nan"),
            "samples": len(records),
            "with_block": sum(len(v) for v in starts.values()),
        }

    def describe(self, stats: dict[str, float]) -> str:
        return (
            f"block start position: spread within groups sharing Z "
            f"{stats['within_group_std']:.2f}, across all samples of a prompt "
            f"{stats['across_groups_std']:.2f} (samples with a block: "
            f"{stats['with_block']}/{stats['samples']})"
        )

"""Tiny local tokenizer stub + synthetic map-style dataset for the torchtune CPU benchmark.

All sequences are exactly `seq_len` tokens in [0, vocab_size). The data come from a fixed
torch.Generator (seeded), following a noisy deterministic "bigram" rule so that the loss
has something to learn:  next = (mult * prev + add) % vocab  with prob (1 - noise),
otherwise a uniformly random token.
"""

from typing import Any

import torch
from torch.utils.data import Dataset


class TinyTokenizer:
    """Minimal tokenizer stub: the recipe only needs `pad_id` (used by the collator)."""

    def __init__(
        self,
        vocab_size: int = 512,
        pad_id: int = 0,
        bos_id: int = 1,
        eos_id: int = 2,
        max_seq_len: int = 256,
    ):
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.max_seq_len = max_seq_len

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = [b % self.vocab_size for b in text.encode("utf-8")]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


class SyntheticTokensDataset(Dataset):
    def __init__(
        self,
        tokenizer: Any = None,
        num_samples: int = 512,
        seq_len: int = 256,
        vocab_size: int = 512,
        seed: int = 1234,
        mult: int = 37,
        add: int = 11,
        noise: float = 0.1,
        packed: bool = False,
    ):
        assert not packed, "packing not supported (all sequences already have seq_len tokens)"
        self.packed = False
        g = torch.Generator().manual_seed(seed)
        toks = torch.empty(num_samples, seq_len, dtype=torch.long)
        toks[:, 0] = torch.randint(0, vocab_size, (num_samples,), generator=g)
        rnd = torch.randint(0, vocab_size, (num_samples, seq_len), generator=g)
        use_rnd = torch.rand(num_samples, seq_len, generator=g) < noise
        for i in range(1, seq_len):
            det = (toks[:, i - 1] * mult + add) % vocab_size
            toks[:, i] = torch.where(use_rnd[:, i], rnd[:, i], det)
        self._data = toks.tolist()

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, idx: int) -> dict[str, list[int]]:
        t = self._data[idx]
        return {"tokens": list(t), "labels": list(t)}

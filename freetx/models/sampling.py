"""The sampling primitives of generation (`freetx.models.generation.generate`, the
engine `freetx.models.engine`): how each next token is chosen (`Sampling`), each row's
own uniforms (`Draws`), what a generation made (`Generated`) and the entropy of the
distribution a token was drawn from (`entropy_of`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen: `temperature` 0 is greedy (the most likely token);
    else from softmax(logits / temperature), kept to the `top_k` most likely tokens and
    to the smallest set whose probability reaches `top_p` (None: no limit)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32: the distribution tokens are drawn from (temperature > 0)."""
        logits = logits.float() / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p is not None and self.top_p < 1:
            ordered, order = probs.sort(dim=-1, descending=True)
            before = ordered.cumsum(dim=-1) - ordered  # the mass of the likelier tokens
            ordered = ordered.masked_fill(before >= self.top_p, 0.0)  # the first always stays
            probs = torch.zeros_like(probs).scatter(-1, order, ordered)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def next_tokens(self, logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """[rows] the chosen tokens of `logits` [rows, vocab], each row's by its uniform in
        [0, 1) (unread when greedy)."""
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        probs = self.probabilities(logits)
        cumulative = probs.cumsum(dim=-1)
        target = uniforms.to(cumulative)[:, None] * cumulative[:, -1:]
        chosen = torch.searchsorted(cumulative, target, right=True).squeeze(1)
        return chosen.clamp(max=logits.shape[-1] - 1)


class Draws:
    """Each row's uniforms in [0, 1), one per generated token: `uniforms` [rows, steps]."""

    def __init__(self, uniforms: torch.Tensor) -> None:
        self.uniforms = uniforms

    @classmethod
    def seeded(cls, seeds: Sequence[int], steps: int) -> Draws:
        """Row r's from a generator seeded with seeds[r] (the same on any device)."""
        rows = [torch.rand(steps, generator=torch.Generator().manual_seed(s)) for s in seeds]
        return cls(torch.stack(rows) if rows else torch.zeros(0, steps))

    @classmethod
    def keyed(cls, keys: Sequence[str], steps: int) -> Draws:
        """Row r's from a generator seeded by keys[r] (any text naming the row: a run's
        seed, step, prompt and sample), whatever batch or process it is sampled in."""
        digest = [hashlib.sha256(key.encode()).digest()[:8] for key in keys]
        return cls.seeded([int.from_bytes(d, "little") & (2**63 - 1) for d in digest], steps)

    @classmethod
    def from_generator(cls, generator: torch.Generator, rows: int, steps: int) -> Draws:
        """[rows, steps] uniforms drawn from one generator, row after row."""
        return cls(torch.rand(rows, steps, generator=generator, device=generator.device))


class Generated(NamedTuple):
    """What `generate` made of R prompts: `tokens` [R, steps] each row's generated ids
    (after its end token: whatever followed, not a reply), `lengths` [R] its reply's
    tokens (its first end token included), `ended` [R] whether it reached one,
    `entropy` [R, steps] the entropy of the distribution each token was drawn from
    (nats; 0 past a row's end)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    ended: torch.Tensor
    entropy: torch.Tensor
    stats: Any = None  # the engine's `EngineStats` (None: the static batch)

    def replies(self) -> list[list[int]]:
        """Each row's reply ids, its end token included."""
        return [row[:n] for row, n in zip(self.tokens.tolist(), self.lengths.tolist())]


def entropy_of(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[rows]: the entropy of the distribution a token is drawn from (the model's own,
    temperature-scaled and filtered; greedy: the untempered softmax's)."""
    if sampling.temperature == 0:
        probs = torch.softmax(logits.float(), dim=-1)
    else:
        probs = sampling.probabilities(logits)
    return -(probs * probs.clamp(min=1e-30).log()).sum(dim=-1)

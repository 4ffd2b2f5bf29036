"""Sampling replies from a language model, a batch of prompts at a time: the `generate`
recipe's and GRPO's rollouts.

    sampling = Sampling(temperature=1.0, top_p=0.95)
    draws = Draws.seeded([seed_of_row, ...], max_new_tokens)     # or Draws.from_generator
    out = generate(model, prompts, max_new_tokens, sampling, end_ids, draws)
    out.tokens[r, : out.lengths[r]]                              # row r's reply, its end token kept

Prompts of different lengths are left-padded to the longest. A model with a KV cache
(`DecodesIncrementally`) reads the prompts once and then one token per row at a time
(padding keys masked, positions from each row's first real token); any other model runs
a full forward over the whole sequence per token (`forward`, e.g. a latent model's with
its codes). Generation stops once every row has reached an end token.

Each row draws its tokens from its own uniforms (`Draws`): the token whose cumulative
probability first passes the row's draw (inverse-CDF sampling over the filtered
distribution). So a row's reply depends on its own draws alone, not on which other rows
share its batch: GRPO's rollouts are the same on 1 or N processes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from freetx.models.protocol import DecodesIncrementally


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


def sampling_problems(values: dict[str, Any]) -> dict[str, str]:
    """A sampling config's values no run can use, by key (`ChecksMeaning`): a top_p
    outside (0, 1]; a KV cache (`kv_cache`) for an HF folder's model (`checkpoint`) that
    cannot generate from one (`freetx.models.hf_generic.cache_problem`), said before any
    weight is read."""
    top_p = values.get("top_p")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        return {
            "top_p": "it is the probability mass of the likeliest tokens kept; set a "
            "value in (0, 1], or null for every token."
        }
    problem = _folder_cache_problem(values.get("checkpoint")) if values.get("kv_cache") else None
    return {"kv_cache": problem} if problem else {}


def _folder_cache_problem(checkpoint: Any) -> str | None:
    """`cache_problem` of the generic model of an HF folder; None for anything else (a
    run's checkpoint: `new_cache` refuses it once built)."""
    from freetx.errors import CheckpointError, ConfigError
    from freetx.models.hf import NATIVE_LAYOUTS, read_hf_config
    from freetx.models.hf_generic import cache_problem, transformers_causal_lm_types

    if (
        not isinstance(checkpoint, str)
        or not (Path(checkpoint).expanduser() / "config.json").is_file()
    ):
        return None
    try:
        hf = read_hf_config(checkpoint)
        native = any(hf.get("model_type") in layout.model_types for layout in NATIVE_LAYOUTS)
        if native or hf.get("model_type") not in transformers_causal_lm_types():
            return None
        return cache_problem(hf)
    except (CheckpointError, ConfigError):
        return None  # the folder's own problem: building it says so


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

    def replies(self) -> list[list[int]]:
        """Each row's reply ids, its end token included."""
        return [row[:n] for row, n in zip(self.tokens.tolist(), self.lengths.tolist())]


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling,
    end_ids: Sequence[int],
    draws: Draws,
    use_cache: bool = True,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Generated:
    """Up to `max_new_tokens` tokens after each prompt (token ids, BOS included where the
    model wants one), all rows in one batch; a row ends at its first id of `end_ids`. With
    `use_cache` and a `DecodesIncrementally` model, a KV cache; else `forward(tokens)`
    (default: the model's) over the whole sequence per token, for prompts of one length
    (a full forward has no padding mask). The model is called as it is (eval mode is the
    caller's)."""
    device = _device_of(model)
    longest = max(map(len, prompts))
    padding = torch.tensor([longest - len(p) for p in prompts], device=device)
    tokens = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts], device=device)
    cached = use_cache and isinstance(model, DecodesIncrementally)
    if not cached and bool((padding > 0).any()):
        raise ValueError(
            "generate: a full forward has no padding mask; without a KV cache "
            "sample prompts of one length together"
        )
    cache = model.new_cache(padding, longest + max_new_tokens) if cached else None
    full = forward or model
    ends = torch.tensor(list(end_ids), dtype=torch.long, device=device)
    rows = len(prompts)
    ended = torch.zeros(rows, dtype=torch.bool, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    entropies = []
    uniforms = draws.uniforms.to(device)
    fresh = tokens  # what the cache has not seen
    for step in range(max_new_tokens):
        logits = model(fresh, cache=cache) if cache is not None else full(tokens)
        logits = logits[:, -1]
        new = sampling.next_tokens(logits, uniforms[:, step])
        running = ~ended
        entropies.append(torch.where(running, _entropy(logits, sampling), 0.0))
        lengths += running.long()
        tokens, fresh = torch.cat([tokens, new[:, None]], dim=1), new[:, None]
        ended |= torch.isin(new, ends)
        if bool(ended.all()):
            break
    generated = tokens[:, longest:]
    return Generated(generated, lengths, ended, torch.stack(entropies, dim=1))


def _entropy(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[rows]: the entropy of the distribution a token is drawn from (the model's own,
    temperature-scaled and filtered; greedy: the untempered softmax's)."""
    if sampling.temperature == 0:
        probs = torch.softmax(logits.float(), dim=-1)
    else:
        probs = sampling.probabilities(logits)
    return -(probs * probs.clamp(min=1e-30).log()).sum(dim=-1)


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")

"""Sampling replies from a language model, a batch of prompts at a time: the `generate`
recipe's and GRPO's rollouts.

    sampling = Sampling(temperature=1.0, top_p=0.95)
    draws = Draws.seeded([seed_of_row, ...], max_new_tokens)     # or Draws.from_generator
    out = generate(model, prompts, max_new_tokens, sampling, end_ids, draws)
    out.tokens[r, : out.lengths[r]]                              # row r's reply, its end token kept

A model that decodes in blocks (`DecodesInBlocks`: the native decoder) runs on the
generation engine (`freetx.models.engine`): a fixed number of slots, a finished row's slot
taken by the next at once, keys and values in a paged cache, one prefill per group of rows
with one prompt. Any other model with a KV cache (`DecodesIncrementally`: the generic
transformers path, hybrids with their own cache) is the static batch: prompts left-padded
to the longest, read once, then one token per row at a time (padding keys masked,
positions from each row's first real token) until every row has reached an end token; any
other model runs a full forward over the whole sequence per token (`forward`, e.g. a
latent model's with its codes).

Each row draws its tokens from its own uniforms (`Draws`): the token whose cumulative
probability first passes the row's draw (inverse-CDF sampling over the filtered
distribution). So a row's reply depends on its own draws alone, not on which other rows
share its batch: GRPO's rollouts are the same on 1 or N processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from freetx.models.engine import Engine, EngineConfig, device_of, run_engine
from freetx.models.protocol import DecodesIncrementally
from freetx.models.sampling import Draws, Generated, Sampling, entropy_of

__all__ = [
    "BatchDecoder",
    "Decoder",
    "Draws",
    "Generated",
    "Sampling",
    "decoder",
    "entropy_of",
    "generate",
    "sampling_problems",
]


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


def check_generates(model: torch.nn.Module, what: str) -> None:
    """Refuse a model with no KV cache where `what` (a recipe's generation) samples rows of
    prompts of many lengths in one left-padded batch, which only a KV cache masks."""
    from freetx.errors import ConfigError

    if not isinstance(model, DecodesIncrementally):
        raise ConfigError(
            f"model: {type(model).__name__} has no KV cache (DecodesIncrementally), and "
            f"{what} generates each rank's prompts of different lengths in one left-padded "
            "batch, which only a KV cache masks.",
            fix="Train a decoder LM (freetx.models.transformer.decoder or an HF folder "
            "through freetx.models.hf_model).",
        )


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
    engine: EngineConfig | None = None,
) -> Generated:
    """Up to `max_new_tokens` tokens after each prompt (token ids, BOS included where the
    model wants one); a row ends at its first id of `end_ids`. With `use_cache` and a model
    the engine serves (`EngineConfig.serves`: `DecodesInBlocks`), the generation engine
    (`freetx.models.engine`: continuous batching over a paged cache; `engine` its
    settings, None: the defaults); with another `DecodesIncrementally` model (or
    engine.paged false), the static batch: all rows at once, a dense KV cache; else
    `forward(tokens)` (default: the model's) over the whole sequence per token, for
    prompts of one length (a full forward has no padding mask). The model is called as it
    is (eval mode is the caller's)."""
    engine = engine or EngineConfig()
    if use_cache and forward is None and engine.serves(model):
        out, stats = run_engine(model, prompts, max_new_tokens, sampling, end_ids, draws, engine)
        return out._replace(stats=stats)
    device = device_of(model)
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
        entropies.append(torch.where(running, entropy_of(logits, sampling), 0.0))
        lengths += running.long()
        tokens, fresh = torch.cat([tokens, new[:, None]], dim=1), new[:, None]
        ended |= torch.isin(new, ends)
        if bool(ended.all()):
            break
    generated = tokens[:, longest:]
    return Generated(generated, lengths, ended, torch.stack(entropies, dim=1))


class Decoder(Protocol):
    """Replies to requests as they come (a multi-turn rollout's turns, each added when its
    environment answers): `add` a prompt and its draws, `step` while `busy`, and read each
    request `step` says ended with `reply`. `joins_running`: whether a request added
    between steps joins those decoding (the engine) or waits for the next batch."""

    joins_running: bool

    def add(self, prompt: Sequence[int], uniforms: torch.Tensor) -> int: ...

    @property
    def busy(self) -> bool: ...

    def step(self) -> list[int]: ...

    def reply(self, request: int) -> tuple[list[int], bool, float]: ...


class BatchDecoder:
    """`generate` as a `Decoder`: each `step` replies to every request added since the
    last, all together (the static batch, for the models the engine does not serve)."""

    joins_running = False

    def __init__(self, model, max_new_tokens: int, sampling: Sampling, end_ids, engine) -> None:
        self.model, self.max_new, self.sampling = model, max_new_tokens, sampling
        self.end_ids, self.engine = list(end_ids), engine
        self.waiting: list[tuple[int, list[int], torch.Tensor]] = []
        self.replies: dict[int, tuple[list[int], bool, float]] = {}
        self.requests = 0

    def add(self, prompt: Sequence[int], uniforms: torch.Tensor) -> int:
        self.waiting.append((self.requests, list(prompt), uniforms))
        self.requests += 1
        return self.requests - 1

    @property
    def busy(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list[int]:
        requests, prompts, uniforms = zip(*self.waiting)
        self.waiting = []
        draws = Draws(torch.stack(list(uniforms)))
        out = generate(
            self.model,
            prompts,
            self.max_new,
            self.sampling,
            self.end_ids,
            draws,
            engine=self.engine,
        )
        entropy = out.entropy.sum(dim=1).tolist()
        for r, reply, ended, h in zip(requests, out.replies(), out.ended.tolist(), entropy):
            self.replies[r] = (reply, bool(ended), h)
        return list(requests)

    def reply(self, request: int) -> tuple[list[int], bool, float]:
        return self.replies.pop(request)


def decoder(
    model,
    max_new_tokens: int,
    sampling: Sampling,
    end_ids: Sequence[int],
    engine: EngineConfig | None,
    rows: int,
    longest: int,
) -> Decoder:
    """A `Decoder` for up to `rows` requests at once, of prompts of up to `longest` tokens:
    the generation engine for a model it serves (`engine.slots` of them decoding, None:
    `rows`), else a `BatchDecoder`."""
    engine = engine or EngineConfig()
    if not engine.serves(model):
        return BatchDecoder(model, max_new_tokens, sampling, end_ids, engine)
    served = Engine(model, engine, sampling, end_ids, max_new_tokens)
    served.open(rows, longest)
    return served

"""Sample from a trained model: a decoder, or a model with a latent code per position.

    freetx run generate --config free_transformer/generate checkpoint=runs/free_transformer_tiny

The checkpoint is a run's output_dir (its newest checkpoint), a DCP checkpoint
folder, a .safetensors file or an HF folder; the model is rebuilt from what the
checkpoint recorded. A model with a per-position latent (the `LatentModel`
protocol, e.g. the Free Transformer) gets each position's code drawn once and
kept: from the prior, or for the prompt from the encoder (`posterior_prefill`);
with `fixed_z`, the samples of a group share one code sequence.

A model with a KV cache (`DecodesIncrementally`: the decoder, native or through
transformers) reads each prompt once and then one token per step (`kv_cache: false`: a
full forward per token); every prompt's samples of a group are one batch, the prompts
left-padded to the longest (padding masked, positions from each prompt's first token).
Without a cache (the Free Transformer) each prompt is sampled alone, its groups one after
another (a full forward has no padding mask), as before the cache: the same draws.

Writes `samples.jsonl`, one record per sample: its `prompt`, `group` and `reply` (the
generated text alone, ended at its EOS), `reply_tokens`, and `stopped_at_eos`;
sampling stops once every sample of a batch has reached its EOS. `temperature: 0` is
greedy decoding. The console shows each prompt once, its replies under it, and the
generated tokens per second. `sample_metrics` components measure the samples (e.g.
`freetx.data.letter_block.BlockPositionSpread` on the letter-block task) into
`sample_metrics.json`.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import MISSING

from freetx.checkpoint import load_model, resolve_checkpoint
from freetx.config import at_least, instantiate, write_resolved_config
from freetx.data import checked_tokenizer, encoded_text
from freetx.distributed import init_distributed
from freetx.entry import parse
from freetx.errors import ConfigError
from freetx.fields import written_folder
from freetx.loggers import build_metric_loggers
from freetx.models import DecodesIncrementally, LatentModel
from freetx.models.engine import EngineConfig, check_pool
from freetx.models.generation import Draws, Sampling, generate, sampling_problems
from freetx.models.hf import end_token_ids
from freetx.models.protocol import refuse_scorer
from freetx.training import claim_folder
from freetx.training.export import recorded_run


@dataclass
class GenerateConfig:
    """The schema of generate's configs."""

    checkpoint: str = MISSING  # run output_dir, DCP folder, .safetensors file or HF folder
    output_dir: str = written_folder("runs/generate")
    device: str = "auto"
    seed: int = 0
    tokenizer: Any = field(default_factory=lambda: {"_component_": "freetx.data.ByteTokenizer"})
    prompts: list[str] = field(default_factory=lambda: ["A>"])
    num_groups: int = at_least(1, default=4)  # groups of samples per prompt
    samples_per_group: int = at_least(1, default=8)
    fixed_z: bool = True  # the samples of a group share one latent (latent models only)
    posterior_prefill: bool = False  # the prompt's latent from the encoder, not the prior
    max_new_tokens: int = at_least(1, default=64)
    # keep keys and values between tokens where the model can (DecodesIncrementally);
    # false: a full forward over the whole sequence per token
    kv_cache: bool = True
    # the generation engine: slots, the paged KV cache's blocks, compile (docs/generation.md)
    engine: EngineConfig = field(default_factory=EngineConfig)
    chat: bool = False  # each prompt is a user turn, rendered with the tokenizer's chat template
    stop_at_eos: bool = True  # a sample's text ends at its first EOS
    temperature: float = at_least(0, default=1.0)  # 0: greedy (the most likely token each step)
    top_k: Optional[int] = at_least(1, default=None)
    top_p: Optional[float] = None  # the smallest set of likeliest tokens with this mass (None: all)
    show_samples: int = at_least(0, default=3)  # samples printed per group
    # measurements of the samples: components called with the records, returning metrics
    sample_metrics: list[Any] = field(default_factory=list)
    metric_loggers: list[Any] = field(default_factory=list)

    meaningless = staticmethod(sampling_problems)  # a top_p outside (0, 1]


class GenerateRecipe:
    def __init__(self, cfg: GenerateConfig) -> None:
        self.cfg = cfg
        self.runtime = init_distributed(cfg.device)
        self.device = self.runtime.device
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)

    def setup(self) -> None:
        cfg = self.cfg
        check_pool(cfg.engine, cfg.max_new_tokens)  # before a weight is read
        self.checkpoint = resolve_checkpoint(cfg.checkpoint)
        self.model = model = load_model(self.checkpoint, self.device, seed=cfg.seed)
        refuse_scorer(model, "generate")  # a reward model gives a score, not a next token
        self.latent = isinstance(model, LatentModel)
        self.cached = cfg.kv_cache and isinstance(model, DecodesIncrementally)
        self.tokenizer = checked_tokenizer(instantiate(cfg.tokenizer))
        if cfg.chat and getattr(self.tokenizer, "chat_template", None) is None:
            raise ConfigError(
                "chat=true renders each prompt with the tokenizer's chat template, and this "
                "tokenizer has none. Use freetx.data.HFTokenizer on a model folder with a chat "
                "template, or set chat=false."
            )
        self.measures = [instantiate(node) for node in cfg.sample_metrics]
        claim_folder(cfg.output_dir, "generate")  # no folder taken over; marked as generate's
        self.loggers = build_metric_loggers(cfg.metric_loggers, cfg.output_dir, None, 0)
        self.end_ids = self.ends() if cfg.stop_at_eos else []
        self.sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p)
        kind = f"{type(model).__name__}{' (latent per position)' if self.latent else ''}"
        decoding = "a full forward per token"
        if self.cached:
            paged = cfg.engine.serves(model)
            decoding = "generation engine (paged KV cache)" if paged else "KV cache, static batch"
        self.loggers.write(
            f"generate | {kind} from {self.checkpoint} | device {self.device} | {decoding}"
        )

    def ends(self) -> list[int]:
        """The ids a reply ends at: the tokenizer's EOS, and the model's own end tokens (its
        HF folder's eos_token_id, or that of the folder the run started from), warned
        about when they differ."""
        eos = self.tokenizer.eos_id
        folders = [self.checkpoint, *recorded_run(self.checkpoint)["run_folders"]]
        model_ids = next((ids for f in folders if (ids := end_token_ids(f))), [])
        if model_ids and eos not in model_ids:
            self.loggers.write(
                f"warning: the tokenizer's end token is id {eos}, and the model's config.json "
                f"says eos_token_id {model_ids[0] if len(model_ids) == 1 else model_ids}: "
                "a reply stops at either. Use the model's own tokenizer (tokenizer.path) or "
                "set tokenizer.eos_token to the model's end token."
            )
        return [eos, *(i for i in model_ids if i != eos)]

    def encode(self, prompt: str) -> list[int]:
        tok = self.tokenizer
        if self.cfg.chat:  # the template writes BOS and the assistant's header itself
            return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}], True))
        return encoded_text(tok, prompt)  # as transformers' tok(prompt).input_ids

    def batches(self, prompts: list[list[int]]) -> list[list[int]]:
        """The prompts (indices) sampled in one batch: all of them with a KV cache
        (left-padded); without one, each alone (a full forward has no padding mask), its
        groups one after another, so that its random draws are those of a run of that
        prompt alone."""
        if self.cached:
            return [list(range(len(prompts)))]
        return [[index] for index in range(len(prompts))]

    def latent_codes(self, prompts: list[list[int]], total: int) -> torch.Tensor:
        """Each row's code per position [rows, total, ...], drawn once and kept (shared by
        a prompt's samples with fixed_z); the prompt's from the encoder with
        posterior_prefill. The prompts are of equal length."""
        cfg, n = self.cfg, self.cfg.samples_per_group
        per_prompt = []
        for ids in prompts:
            draws = 1 if cfg.fixed_z else n
            codes = self.model.prior_codes(draws, total, self.generator)
            codes = codes.expand(n, *codes.shape[1:]).clone()
            if cfg.posterior_prefill:  # the prompt's codes from the encoder
                prompt_ids = torch.tensor([ids] * draws, device=self.device)
                codes[:, : len(ids)] = self.model.posterior_codes(prompt_ids, self.generator)
            per_prompt.append(codes)
        return torch.cat(per_prompt)

    def sample(self, prompts: list[list[int]]) -> list[list[dict[str, Any]]]:
        """samples_per_group replies to each prompt (`freetx.models.generation.generate`:
        the generation engine, one prefill per prompt, or the static batch for a model it
        does not serve), each ended at its first EOS (`stop_at_eos`). Returns each
        prompt's replies."""
        cfg, n = self.cfg, self.cfg.samples_per_group
        rows = [ids for ids in prompts for _ in range(n)]
        draws = Draws.from_generator(self.generator, len(rows), cfg.max_new_tokens)
        forward = None
        if self.latent:  # each position's code, drawn before the first token
            codes = self.latent_codes(prompts, max(map(len, prompts)) + cfg.max_new_tokens)
            forward = lambda tokens: self.model(tokens, codes=codes[:, : tokens.shape[1]])[0]  # noqa: E731
        out = generate(
            self.model,
            rows,
            cfg.max_new_tokens,
            self.sampling,
            self.end_ids,
            draws,
            use_cache=self.cached,
            forward=forward,
            engine=cfg.engine,
        )
        replies = [self.reply(row, bool(end)) for row, end in zip(out.replies(), out.ended)]
        return [replies[i * n : (i + 1) * n] for i in range(len(prompts))]

    def reply(self, ids: list[int], ended: bool) -> dict[str, Any]:
        """A reply's record: its text and tokens up to its end token (not counted)."""
        reply = ids[:-1] if ended else ids
        return {
            "reply": self.tokenizer.decode(reply),
            "reply_tokens": len(reply),
            "stopped_at_eos": ended,
        }

    def generate(self) -> None:
        cfg = self.cfg
        records = []
        started = time.perf_counter()
        prompts = [self.encode(prompt) for prompt in cfg.prompts]
        replies: dict[tuple[int, int], list[dict[str, Any]]] = {}  # (prompt, group) ->
        for batch in self.batches(prompts):
            for group in range(cfg.num_groups):
                for index, samples in zip(batch, self.sample([prompts[i] for i in batch])):
                    replies[index, group] = samples
        seconds = time.perf_counter() - started
        for index, prompt in enumerate(cfg.prompts):
            self.loggers.write(f"prompt: {prompt!r}")
            for group in range(cfg.num_groups):
                samples = replies[index, group]
                records += [{"prompt": prompt, "group": group, **s} for s in samples]
                for s in samples[: cfg.show_samples]:
                    self.loggers.write(f"  group {group} reply: {s['reply']!r}")
        generated = sum(r["reply_tokens"] for r in records)
        self.loggers.write(
            f"{len(records)} replies, {generated} tokens in {seconds:.1f} s "
            f"({generated / max(seconds, 1e-9):.1f} tokens/s)"
        )
        out = Path(cfg.output_dir)
        write_resolved_config(cfg)  # beside the samples it made
        with open(out / "samples.jsonl", "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        metrics: dict[str, float] = {}
        for measure in self.measures:
            result = measure(records)
            metrics.update(result)
            describe = getattr(measure, "describe", None)
            self.loggers.write(describe(result) if describe else json.dumps(result))
        if self.measures:
            (out / "sample_metrics.json").write_text(json.dumps(metrics, indent=2))
            self.loggers.log(0, metrics)

    def cleanup(self) -> None:
        self.loggers.close()


@parse(GenerateConfig, supports_distributed=False)
def recipe_main(cfg: GenerateConfig) -> None:
    recipe = GenerateRecipe(cfg)
    recipe.setup()
    recipe.generate()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())

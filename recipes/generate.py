"""Sample from a trained decoder or Free Transformer.

    freetx run generate --config free_transformer/generate checkpoint=runs/free_transformer_tiny

The checkpoint is a run's output_dir (its newest checkpoint), a DCP checkpoint
folder, a .safetensors file or an HF folder; the model is rebuilt from what the
checkpoint recorded. For a Free Transformer each position's Z is drawn once
and kept: from the uniform prior, or for the prompt from the encoder
(`posterior_prefill`). With `fixed_z`, the samples of a group share one Z.

With `letter_block: true` it measures what Z encodes on Fleuret's task: the
spread (standard deviation) of the letter block's start position among samples
that share Z, against the spread over all samples of a prompt.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import MISSING, DictConfig

from freetx.checkpoint import load_initial_weights, model_from_checkpoint, resolve_checkpoint
from freetx.config import instantiate, parse, write_resolved_config
from freetx.data.letter_block import block_start
from freetx.distributed import init_distributed, materialize
from freetx.logging import build_metric_loggers
from freetx.models import build_model
from freetx.models.free_transformer import FreeTransformer, binary_mapper, bits_to_index


@dataclass
class GenerateConfig:
    """The schema of generate's configs."""

    checkpoint: str = MISSING  # run output_dir, DCP folder, .safetensors file or HF folder
    output_dir: str = "runs/generate"
    device: str = "auto"
    seed: int = 0
    tokenizer: Any = field(default_factory=lambda: {"_component_": "freetx.data.ByteTokenizer"})
    prompts: list[str] = field(default_factory=lambda: ["A>"])
    num_groups: int = 4  # groups of samples per prompt
    samples_per_group: int = 8
    fixed_z: bool = True  # the samples of a group share one Z (Free Transformer only)
    posterior_prefill: bool = False  # the prompt's Z from the encoder instead of the prior
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: Optional[int] = None
    letter_block: bool = False  # measure the block's start position (letter-block task)
    show_samples: int = 3  # samples printed per group
    metric_loggers: list[Any] = field(default_factory=list)


class GenerateRecipe:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.runtime = init_distributed(cfg.device)
        self.device = self.runtime.device
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)

    def setup(self) -> None:
        cfg = self.cfg
        self.checkpoint = resolve_checkpoint(cfg.checkpoint)
        model_class, model_config = model_from_checkpoint(self.checkpoint)
        with torch.device("meta"):
            model = build_model(model_class, model_config)
        materialize(model, self.device, seed=cfg.seed)
        load_initial_weights(model, self.checkpoint)
        self.model = model.eval()
        self.latent = isinstance(model, FreeTransformer)
        self.tokenizer = instantiate(cfg.tokenizer)
        self.loggers = build_metric_loggers(cfg.metric_loggers, cfg.output_dir, None, 0)
        kind = "Free Transformer" if self.latent else "decoder"
        self.loggers.write(f"generate | {kind} from {self.checkpoint} | device {self.device}")

    def draw_codes(self, count: int, length: int) -> torch.Tensor:
        """Uniform prior codes [count, length]: one Z per position, drawn once."""
        num_codes = 2**self.model.config.latent_dim
        return torch.randint(
            0, num_codes, (count, length), generator=self.generator, device=self.device
        )

    @torch.no_grad()
    def sample_group(self, prompt: str) -> list[str]:
        """One group: samples_per_group continuations of `prompt` (sharing Z if fixed_z)."""
        cfg, tok = self.cfg, self.tokenizer
        n = cfg.samples_per_group
        ids = [tok.bos_id, *tok.encode(prompt)]
        tokens = torch.tensor([ids] * n, device=self.device)
        total = len(ids) + cfg.max_new_tokens
        codes = None
        if self.latent:
            codes = self.draw_codes(1 if cfg.fixed_z else n, total).expand(n, total).clone()
            if cfg.posterior_prefill:  # the prompt's Z from the encoder, drawn once
                _, z_logits = self.model(tokens[:1] if cfg.fixed_z else tokens)
                noise = torch.rand(z_logits.shape, generator=self.generator, device=self.device)
                _, bits = binary_mapper(z_logits, noise)
                codes[:, : len(ids)] = bits_to_index(bits)
        for _ in range(cfg.max_new_tokens):
            if self.latent:
                logits, _ = self.model(tokens, z_index=codes[:, : tokens.shape[1]])
            else:
                logits = self.model(tokens)
            tokens = torch.cat([tokens, self.next_tokens(logits[:, -1])[:, None]], dim=1)
        return [prompt + tok.decode(row[len(ids) :].tolist()) for row in tokens]

    def next_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float() / max(self.cfg.temperature, 1e-6)
        if self.cfg.top_k:
            kth = torch.topk(logits, self.cfg.top_k).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1)

    def generate(self) -> None:
        cfg = self.cfg
        records = []
        for prompt in cfg.prompts:
            for group in range(cfg.num_groups):
                samples = self.sample_group(prompt)
                records += [{"prompt": prompt, "group": group, "text": s} for s in samples]
                self.loggers.write(f"{prompt!r} group {group}:")
                for text in samples[: cfg.show_samples]:
                    self.loggers.write(f"  {text}")
        out = Path(cfg.output_dir)
        write_resolved_config(cfg)  # beside the samples it made
        with open(out / "samples.jsonl", "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        if cfg.letter_block:
            stats = block_position_spread(records)
            (out / "letter_block_stats.json").write_text(json.dumps(stats, indent=2))
            self.loggers.write(
                f"block start position: spread within groups sharing Z "
                f"{stats['within_group_std']:.2f}, across all samples of a prompt "
                f"{stats['across_groups_std']:.2f} (samples with a block: "
                f"{stats['with_block']}/{stats['samples']})"
            )
            self.loggers.log(0, stats)

    def cleanup(self) -> None:
        self.loggers.close()


def block_position_spread(records: list[dict]) -> dict[str, float]:
    """Mean std of the block's start within groups vs over all samples of a prompt."""
    starts: dict[tuple[str, int], list[int]] = {}
    for record in records:
        position = block_start(record["text"])
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


@parse(GenerateConfig, supports_distributed=False)
def recipe_main(cfg: DictConfig) -> None:
    recipe = GenerateRecipe(cfg)
    recipe.setup()
    recipe.generate()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())

"""Train a sparse crosscoder on model activations (or planted synthetic features), FSDP2.

    freetx run --nproc-per-node 2 crosscoder_fsdp2 --config crosscoder/synthetic_tiny
    freetx run --nproc-per-node 2 crosscoder_fsdp2 --config crosscoder/diff_tiny

Setup reads the activations (synthetic rows, a cache written once, or a buffer
refilled by running the frozen source models on this rank's own text), scales
each source to mean norm sqrt(d) with constants estimated on every rank and
all-reduced, and builds the crosscoder: its dictionary is the big tensor and
FSDP2 shards it by feature. The loop is the LM recipe's: micro-batches of rows,
the loss computed inside the model's forward (summed over rows; gradients
normalized by the rows of the global batch), clip, step, schedule (the
sparsity weight warms up linearly), log (loss parts, L0, explained variance
total and per source, dead features over the window since the last log),
evaluate (also the CE loss recovered when the reconstruction is spliced into
the source models), checkpoint.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

import torch
from omegaconf import MISSING

from freetx.checkpoint import load_model
from freetx.config import at_least, instantiate
from freetx.data import build_train_loader, micro_batch_size
from freetx.data.activations import (
    ActivationBuffer,
    ActivationHarvester,
    build_activation_cache,
    keep_positions,
    norm_sums,
    scales_from_norm_sums,
)
from freetx.data.shard_cache import ShardCache
from freetx.distributed import build_groups, init_distributed, parallelize
from freetx.entry import parse
from freetx.errors import ConfigError
from freetx.models.crosscoder import CrosscoderStats
from freetx.training import (
    TrainingConfig,
    TrainingRun,
    accumulate_gradients,
    build_lr_scheduler,
    optimizer_step,
    seed_everything,
)


@dataclass
class SourceConfig:
    """A model to read: a freetx run / checkpoint, or an HF folder (any architecture,
    through transformers), and the modules whose outputs are read."""

    model: str = MISSING
    hooks: list[str] = field(default_factory=list)


@dataclass
class ActivationsConfig:
    kind: Literal["synthetic", "models"] = "synthetic"
    synthetic: Any = field(default_factory=lambda: {"_component_": "freetx.data.PlantedFeatures"})
    sources: list[SourceConfig] = field(default_factory=list)  # models: in order
    tokenizer: Any = field(default_factory=lambda: {"_component_": "freetx.data.ByteTokenizer"})
    text: Any = field(default_factory=lambda: {
        "_component_": "freetx.data.PackedTextDataset", "source": "builtin", "seq_len": 64})  # fmt: skip
    mode: Literal["buffer", "cache"] = "buffer"
    sequences_per_refill: int = at_least(1, default=32)  # buffer: per rank, per refill
    cache: Optional[str] = None  # cache: the folder (written once, reused, checked)
    source_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on CUDA
    normalize_rows: int = at_least(1, default=4096)  # per rank, to estimate the scales


@dataclass
class SparsityConfig:
    coeff: float = 0.8  # lambda: l1_coeff (relu), lambda_S (jumprelu); unused by batchtopk
    warmup_fraction: float = 0.05  # linear warm-up from 0 over this share of the steps


@dataclass
class CrosscoderEvalConfig:
    every_n_steps: int = at_least(0, default=0)  # 0: only at the end of training
    rows: int = at_least(1, default=8192)  # validation rows per rank


@dataclass
class CrosscoderConfig(TrainingConfig):
    """crosscoder_fsdp2's schema: TrainingConfig's keys, then these. batch_size counts
    activation rows (tokens) per optimizer step over all ranks (the seed's batch_size x
    GPUs x accumulation)."""

    fixed_on_resume: ClassVar[tuple[str, ...]] = (
        *TrainingConfig.fixed_on_resume, "model", "activations",
    )  # fmt: skip

    model: Any = MISSING  # freetx.models.crosscoder.crosscoder (sources and d from the data)
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    eval: CrosscoderEvalConfig = field(default_factory=CrosscoderEvalConfig)


class CrosscoderRecipeFSDP2:
    def __init__(self, cfg: CrosscoderConfig) -> None:
        self.cfg = cfg
        self.runtime = init_distributed(cfg.device, cfg.distributed.collective_timeout_s)
        self.device = self.runtime.device
        self.accumulation = cfg.gradient_accumulation_steps
        seed_everything(cfg.seed, self.runtime.rank)

    def setup(self) -> None:
        cfg = self.cfg
        self.groups = build_groups(self.runtime, cfg.distributed)  # the ranks: dp, world
        self.run = TrainingRun(cfg, self.groups, "crosscoder_fsdp2")
        world_size = self.groups.dp_size
        rows_per_batch = micro_batch_size(cfg.batch_size, world_size, self.accumulation)
        self.make_data(rows_per_batch)
        with torch.device("meta"):
            model = instantiate(cfg.model, num_sources=self.num_sources, source_dim=self.source_dim)
        self.plan = parallelize(
            model, self.groups, cfg.distributed, seed=cfg.seed,
            init_weights=not self.run.loads_weights,
        )  # fmt: skip
        self.model = self.plan.model
        if not self.run.loads_weights:  # a resume restores both from the checkpoint
            self.plan.module.tie_encoder()
            self.plan.module.input_scale.copy_(self.estimate_scales())
        self.optimizer = self.plan.build_optimizer(cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.max_steps, cfg.lr_schedule)
        c = self.plan.module.config
        self.stats = CrosscoderStats(c.num_sources, c.source_dim, c.dict_size)
        self.run.start(
            self.plan, self.optimizer, self.lr_scheduler, self.train_loader, tokens_per_sample=1,
            sources=self.num_sources, source_dim=self.source_dim, dict_size=c.dict_size,
            activation=c.activation, data=self.data_description,
        )  # fmt: skip

    # -- data ---------------------------------------------------------------------
    def make_data(self, rows_per_batch: int) -> None:
        """Training rows (a loader), validation rows, and the sources' shape."""
        cfg, acfg = self.cfg, self.cfg.activations
        rank, world_size = self.groups.dp_rank, self.groups.dp_size
        self.harvester = None
        if acfg.kind == "synthetic":
            train = instantiate(acfg.synthetic, split="train")
            self.planted = train
            self.val_rows = instantiate(acfg.synthetic, split="validation").rows[: cfg.eval.rows]
            self.train_loader = build_train_loader(
                train, cfg.batch_size, self.accumulation, rank, world_size, cfg.seed
            )
            self.data_description = f"synthetic ({len(train):,} rows)"
            self.num_sources, self.source_dim = train.num_sources, train.source_dim
            self.normalize_from = train.rows
            return
        self.planted = None
        if not acfg.sources:
            raise ConfigError(
                "activations.kind=models needs activations.sources: a list of {model: PATH, "
                "hooks: [module names]}."
            )
        self.tokenizer = instantiate(acfg.tokenizer)
        self.text = instantiate(acfg.text, tokenizer=self.tokenizer, split="train")
        self.val_text = instantiate(acfg.text, tokenizer=self.tokenizer, split="validation")
        self.harvester = ActivationHarvester([
            (self.source_model(s.model), list(s.hooks), s.model) for s in acfg.sources
        ])  # fmt: skip
        drop = [t for t in (self.tokenizer.bos_id, self.tokenizer.pad_id) if t is not None]
        self.drop_ids = drop

        def harvest(input_ids: torch.Tensor) -> torch.Tensor:
            return self.harvester(input_ids, keep_positions(input_ids, drop)).cpu()

        sample = harvest(torch.stack([self.text[0]["input_ids"]]))
        self.num_sources, self.source_dim = sample.shape[1], sample.shape[2]
        if acfg.mode == "cache":
            if not acfg.cache:
                raise ConfigError("activations.mode=cache needs activations.cache: a folder.")
            settings = {
                "sources": [{"model": s.model, "hooks": list(s.hooks)} for s in acfg.sources],
                "text": repr(acfg.text), "tokenizer": repr(acfg.tokenizer),
            }  # fmt: skip
            rows = build_activation_cache(
                ShardCache(acfg.cache), harvest, self.text, rank, world_size, settings,
                barrier=self.barrier,
            )  # fmt: skip
            self.train_loader = build_train_loader(
                rows, cfg.batch_size, self.accumulation, rank, world_size, cfg.seed
            )
            self.normalize_from = rows.rows[rank::world_size][: acfg.normalize_rows]
            self.data_description = f"cache {acfg.cache} ({len(rows):,} rows)"
        else:
            self.train_loader = ActivationBuffer(
                harvest, self.text, rows_per_batch, acfg.sequences_per_refill, rank,
                world_size, cfg.seed,
            )  # fmt: skip
            self.normalize_from = harvest(torch.stack([
                self.text[i]["input_ids"]
                for i in self.train_loader.mine[: acfg.sequences_per_refill]
            ]))  # fmt: skip
            self.data_description = f"buffer ({acfg.sequences_per_refill} sequences a refill)"
        self.val_rows = self.validation_rows(harvest)

    def source_model(self, path: str):
        """A frozen source: freetx's own model of a run or checkpoint (or a Llama-family HF
        folder), else any HF folder through transformers (bf16 on CUDA)."""
        dtype = self.source_dtype()
        try:
            return load_model(path, self.device).to(dtype)
        except Exception as freetx_error:
            try:
                from transformers import AutoModelForCausalLM
            except ImportError:
                raise freetx_error from None
            from pathlib import Path

            if not (Path(path).expanduser() / "config.json").is_file():
                raise
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            return model.to(self.device).eval()

    def source_dtype(self) -> torch.dtype:
        choice = self.cfg.activations.source_dtype
        if choice == "auto":
            return torch.bfloat16 if self.device.type == "cuda" else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[choice]

    def validation_rows(self, harvest) -> torch.Tensor:
        """This rank's validation rows, from its own validation sequences."""
        rank, world_size = self.groups.dp_rank, self.groups.dp_size
        parts, count = [], 0
        for i in range(rank, len(self.val_text), world_size):
            rows = harvest(torch.stack([self.val_text[i]["input_ids"]]))
            parts.append(rows)
            count += len(rows)
            if count >= self.cfg.eval.rows:
                break
        if not parts:
            raise ConfigError("the text's validation split is empty; raise dataset val_fraction.")
        return torch.cat(parts)[: self.cfg.eval.rows]

    def barrier(self) -> None:
        self.groups.barrier()

    def estimate_scales(self) -> torch.Tensor:
        """Per source, sqrt(d) / mean ||x||, from rows of every rank (all-reduced): the
        same constants on every rank; stored with the model (and its checkpoints)."""
        norms, count = norm_sums(self.normalize_from[: self.cfg.activations.normalize_rows])
        count = torch.tensor(float(count), device=self.device)
        totals = self.groups.sum_tensors({"norms": norms.to(self.device), "count": count})
        scales = scales_from_norm_sums(totals["norms"], float(totals["count"]), self.source_dim)
        return scales.to(self.device)

    # -- the loop -------------------------------------------------------------------
    def train(self) -> None:
        cfg, run = self.cfg, self.run
        data = iter(self.train_loader)
        self.model.train()
        while run.step < cfg.max_steps and not run.stopping:  # stopping: SIGTERM, ^C
            batches = [next(data) for _ in range(self.accumulation)]
            self.optimizer.zero_grad(set_to_none=True)
            sums, rows = accumulate_gradients(
                self.plan, batches, self.compute_loss, count=lambda b: len(b["x"])
            )
            grad_norm = optimizer_step(
                self.plan, self.optimizer, self.lr_scheduler, cfg.max_grad_norm
            )
            run.advance(grad_norm)  # the NaN guard: a non-finite norm skipped the update
            if run.log_due():
                run.log_train(sums, rows, grad_norm)
                run.log(self.stats.read(self.groups.sum_tensors))
            if run.due(cfg.eval.every_n_steps):
                run.evaluate(self.evaluate)
            if run.due(cfg.checkpoint.every_n_steps):
                run.save()
        run.finish(self.evaluate)

    def sparsity_weight(self) -> float:
        """The sparsity coefficient, warmed up linearly from 0 (the seed's l1 warm-up)."""
        warmup = self.cfg.sparsity.warmup_fraction * self.cfg.max_steps
        ramp = 1.0 if warmup <= 0 else min(1.0, (self.run.step + 1) / warmup)
        return self.cfg.sparsity.coeff * ramp

    def compute_loss(self, batch: dict[str, torch.Tensor]):
        """One micro-batch of rows: the loss summed over them (+ sums to log)."""
        loss, extras = self.model(batch["x"].to(self.device), self.sparsity_weight())
        self.stats.update(extras)
        keep = ("recon_loss", "sparsity_loss", "l0", "pre_act_loss", "aux_loss")
        return loss, {k: v for k, v in extras.items() if k in keep}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """On the validation rows (every rank its own, summed): loss parts, L0, explained
        variance; the planted features' recovery (synthetic); the CE loss recovered when
        the reconstruction replaces the hooked activations (models)."""
        self.model.eval()
        stats = CrosscoderStats(*self.stats.shape)
        sums: dict[str, torch.Tensor] = {}
        for start in range(0, len(self.val_rows), 1024):
            x = self.val_rows[start : start + 1024].float().to(self.device)
            _, extras = self.model(x, self.cfg.sparsity.coeff)
            stats.update(extras)
            for key in ("recon_loss", "l0"):
                sums[key] = sums.get(key, 0) + extras[key].double()
        sums["rows"] = torch.tensor(float(len(self.val_rows)), dtype=torch.float64)
        totals = self.groups.sum_tensors(
            {k: torch.as_tensor(v).to(self.device) for k, v in sums.items()}
        )
        rows = float(totals.pop("rows"))
        metrics = {f"val/{k}": float(v) / rows for k, v in totals.items()}
        metrics.update({f"val/{k}": v for k, v in stats.read(self.groups.sum_tensors).items()})
        decoder = self.full_decoder()
        if self.planted is not None:
            metrics.update(self.planted.recovery(decoder.cpu()))
        if self.harvester is not None:
            metrics.update(self.ce_recovered())
        self.model.train()
        return metrics

    def full_decoder(self) -> torch.Tensor:
        """W_dec whole on every rank (a collective when sharded)."""
        weight = self.plan.module.W_dec
        return weight.full_tensor() if hasattr(weight, "full_tensor") else weight.detach()

    def ce_recovered(self) -> dict[str, float]:
        """(L_zero - L_splice) / (L_zero - L_clean) per source model, on validation text:
        the models' next-token loss with their hooked activations as they are, replaced
        by the crosscoder's reconstruction, and replaced by zeros."""
        count = min(8, len(self.val_text))
        batch = torch.stack([self.val_text[i]["input_ids"] for i in range(count)])
        keep = keep_positions(batch, self.drop_ids)

        def reconstruct(x: torch.Tensor) -> torch.Tensor:  # [B, T, n, d]
            rows = x.flatten(0, 1).float().to(self.device)
            return self.plan.inference_model.reconstruct(rows).reshape(x.shape).to(x.dtype)

        clean, splice, zero = (
            self.harvester.spliced_loss(batch, keep, replace)
            for replace in (lambda x: x, reconstruct, torch.zeros_like)
        )
        tokens = float(keep[:, 1:].sum())
        metrics = {}
        for i, (c, s, z) in enumerate(zip(clean, splice, zero)):
            metrics[f"val/ce_recovered/model_{i}"] = float((z - s) / (z - c).clamp_min(1e-12))
            metrics[f"val/ce_clean/model_{i}"] = float(c) / tokens
            metrics[f"val/ce_splice/model_{i}"] = float(s) / tokens
        return metrics

    def cleanup(self) -> None:
        self.run.close()


@parse(CrosscoderConfig)
def recipe_main(cfg: CrosscoderConfig) -> None:
    recipe = CrosscoderRecipeFSDP2(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())

"""Train a sparse crosscoder on model activations (or planted synthetic features), FSDP2.

    freetx run --nproc-per-node 2 crosscoder_fsdp2 --config crosscoder/synthetic_tiny
    freetx run --nproc-per-node 2 crosscoder_fsdp2 --config crosscoder/diff_tiny

Setup reads the activations (synthetic rows, a cache written once, or a buffer
refilled by running the frozen source models on this rank's own text), scales
each source to mean norm sqrt(d) with constants estimated on every rank and
all-reduced (and, with `model.apply_b_dec_to_input`, starts the decoder bias at the
scaled rows' mean), and builds the crosscoder: its dictionary is the big tensor and
FSDP2 shards it by feature. The loop is the LM recipe's: micro-batches of rows,
the loss (`CrosscoderLoss`, its collectives over the recipe's groups) computed
inside the model's forward (summed over rows; gradients normalized by the rows
of the global batch), clip, step, schedule (the sparsity weight warms up
linearly), log (loss parts, L0, explained variance total and per source, dead
features over the window since the last log), evaluate (also the CE loss
recovered when the reconstruction is spliced into the source models),
checkpoint.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from omegaconf import MISSING

from freetx.checkpoint import files_read_by, input_identity, load_source_model
from freetx.config import at_least, instantiate
from freetx.data import (
    Activations,
    ActivationsConfig,
    RowLoading,
    checked_tokenizer,
    harvested_activations,
    micro_batch_size,
    planted_activations,
)
from freetx.data.activations import norm_sums, scales_from_norm_sums
from freetx.distributed import (
    build_groups,
    fill_parameters,
    full_norm,
    full_tensor,
    init_distributed,
    local_parameters,
    parallelize,
)
from freetx.entry import parse
from freetx.models.crosscoder import CrosscoderLoss, CrosscoderStats
from freetx.models.hf import own_module_name
from freetx.training import (
    PlannedRun,
    TrainingConfig,
    TrainingRun,
    accumulate_gradients,
    build_lr_scheduler,
    optimizer_step,
    seed_everything,
)


@dataclass
class SparsityConfig:
    coeff: float = 0.8  # lambda: l1_coeff (relu), lambda_S (jumprelu); unused by batchtopk
    warmup_fraction: float = 0.05  # linear warm-up from 0 over this share of the steps


@dataclass
class CrosscoderEvalConfig:
    every_n_steps: int = at_least(0, default=0)  # 0: only at the end of training
    rows: int = at_least(1, default=8192)  # validation rows over all ranks (split between them)


@dataclass
class CrosscoderConfig(TrainingConfig):
    """crosscoder_fsdp2's schema: TrainingConfig's keys, then these. batch_size counts
    activation rows (tokens) per optimizer step over all ranks (the seed's batch_size x
    GPUs x accumulation)."""

    fixed_on_resume: ClassVar[tuple[str, ...]] = (
        *TrainingConfig.fixed_on_resume,
        "model",
        "activations",
    )

    model: Any = MISSING  # freetx.models.crosscoder.crosscoder (sources and d from the data)
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    eval: CrosscoderEvalConfig = field(default_factory=CrosscoderEvalConfig)

    def planned(self) -> PlannedRun:  # rows of one token's activations from its sources
        return PlannedRun(self.model, seq_len=1, activations=self.activations)


class CrosscoderRecipeFSDP2:
    def __init__(self, cfg: CrosscoderConfig) -> None:
        self.cfg = cfg
        self.runtime = init_distributed(cfg.device, cfg.distributed.collective_timeout_s)
        self.device = self.runtime.device
        self.accumulation = cfg.gradient_accumulation_steps
        self.files_read: dict[str, list] = {}  # what the text and tokenizer read (models)
        seed_everything(cfg.seed, self.runtime.rank, cfg.deterministic)

    def setup(self) -> None:
        cfg = self.cfg
        self.groups = build_groups(self.runtime, cfg.distributed)  # the ranks: dp, world
        self.run = TrainingRun(cfg, self.groups, "crosscoder_fsdp2")
        micro_batch_size(cfg.batch_size, self.groups.dp_size, self.accumulation)  # it splits
        self.data = self.build_data()
        num_sources, source_dim = self.data.shape
        with torch.device("meta"):
            model = instantiate(cfg.model, num_sources=num_sources, source_dim=source_dim)
        self.plan = parallelize(
            model,
            self.groups,
            cfg.distributed,
            seed=cfg.seed,
            init_weights=not self.run.loads_weights,
        )
        self.model = self.plan.model
        if not self.run.loads_weights:  # a resume restores both from the checkpoint
            module = self.plan.module
            module.tie_encoder(local_parameters(module))
            scales, mean = self.estimate_scales()
            module.input_scale.copy_(scales)
            if module.config.apply_b_dec_to_input:  # centered from the first step
                fill_parameters(module, lambda name, p: mean, only=lambda name: name == "b_dec")
        self.optimizer = self.plan.build_optimizer(cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.max_steps, cfg.lr_schedule)
        self.loss_fn = CrosscoderLoss(self.groups)  # its state advances in training only
        c = self.plan.module.config
        self.stats = CrosscoderStats(c.num_sources, c.source_dim, c.dict_size)
        self.run.start(
            self.plan,
            self.optimizer,
            self.lr_scheduler,
            self.data.train_loader,
            tokens_per_sample=1,
            inputs={**self.source_models(), **self.files_read},
            sources=num_sources,
            source_dim=source_dim,
            dict_size=c.dict_size,
            activation=c.activation,
            data=self.data.description,
        )

    def build_data(self) -> Activations:
        """Planted synthetic rows, or the hooked outputs of the source models on text."""
        cfg, acfg = self.cfg, self.cfg.activations
        loading = RowLoading(
            cfg.batch_size,
            self.accumulation,
            self.groups.dp_rank,
            self.groups.dp_size,
            cfg.seed,
            eval_rows=cfg.eval.rows,
            normalize_rows=acfg.normalize_rows,
        )
        if acfg.kind == "synthetic":
            train = instantiate(acfg.synthetic, split="train")
            return planted_activations(
                train, instantiate(acfg.synthetic, split="validation"), loading
            )
        tokenizer = checked_tokenizer(instantiate(acfg.tokenizer), "activations.tokenizer")
        text = instantiate(acfg.text, tokenizer=tokenizer, split="train")
        val_text = instantiate(acfg.text, tokenizer=tokenizer, split="validation")
        models = [load_source_model(s.model, self.device, acfg.source_dtype) for s in acfg.sources]
        # a hook named as transformers names the module (model.layers.13) reads the same
        # activations from freetx's own decoder of that folder (layers.13)
        hooks = [[own_module_name(m, h) for h in s.hooks] for m, s in zip(models, acfg.sources)]
        identities = [input_identity(path) for path in self.source_models().values()]
        self.files_read = files_read_by(
            **{"activations.tokenizer": tokenizer, "activations.text": text}
        )
        files = {name: input_identity(paths) for name, paths in self.files_read.items()}
        return harvested_activations(
            acfg,
            models,
            hooks,
            identities,
            files,
            tokenizer,
            text,
            val_text,
            loading,
            self.groups.barrier,
        )

    def source_models(self) -> dict[str, str]:
        """The models the activations come from (none for planted rows), by config key:
        recorded by identity in every checkpoint, checked on resume."""
        if self.cfg.activations.kind == "synthetic":
            return {}
        sources = self.cfg.activations.sources
        return {f"activations.sources[{i}].model": s.model for i, s in enumerate(sources)}

    def estimate_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per source, sqrt(d) / mean ||x|| [n], and the mean of the rows so scaled [n, d],
        from rows of every rank (all-reduced): the same constants on every rank; the scales
        are stored with the model (and its checkpoints)."""
        rows = self.data.normalize_from
        norms, count = norm_sums(rows)
        totals = self.groups.sum_tensors({
            "norms": norms.to(self.device),
            "count": torch.tensor(float(count), device=self.device),
            "sums": rows.float().sum(0).to(self.device),
        })  # fmt: skip
        count, source_dim = float(totals["count"]), self.data.shape[1]
        scales = scales_from_norm_sums(totals["norms"], count, source_dim).to(self.device)
        return scales, totals["sums"] * scales[:, None] / max(count, 1.0)

    # -- the loop -------------------------------------------------------------------
    def train(self) -> None:
        cfg, run = self.cfg, self.run
        data = iter(self.data.train_loader)
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
                run.log(
                    {
                        **self.stats.read(self.groups.sum_tensors),
                        "l1_coeff": self.sparsity_weight(run.step),  # as the seed logs them
                        "W_dec_norm": full_norm(self.plan.module.W_dec),
                    }
                )
            if run.due(cfg.eval.every_n_steps):
                run.evaluate(self.evaluate)
            if run.due(cfg.checkpoint.every_n_steps):
                run.save()
        run.finish(self.evaluate)

    def sparsity_weight(self, step: int) -> float:
        """The sparsity coefficient of optimizer step `step` (from 1), warmed up linearly
        from 0 over `sparsity.warmup_fraction` of the steps (the seed's l1 warm-up)."""
        warmup = self.cfg.sparsity.warmup_fraction * self.cfg.max_steps
        ramp = 1.0 if warmup <= 0 else min(1.0, step / warmup)
        return self.cfg.sparsity.coeff * ramp

    def compute_loss(self, batch: dict[str, torch.Tensor]):
        """One micro-batch of rows: the loss summed over them (+ sums to log)."""
        weight = self.sparsity_weight(self.run.step + 1)  # the step this batch is for
        output = self.model(batch["x"].to(self.device), self.loss_fn, weight)
        self.stats.add(output.stats)
        return output.loss, output.log_sums()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """On the validation rows (every rank its share, summed): reconstruction loss, L0,
        explained variance; the planted features' recovery (synthetic); the CE loss
        recovered when the reconstruction replaces the hooked activations (models)."""
        self.model.eval()  # the loss's state (dead features, threshold EMA) stays as it is
        stats = CrosscoderStats(*self.stats.shape)
        recon, l0 = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        val_rows = self.data.val_rows
        for start in range(0, len(val_rows), 1024):
            x = val_rows[start : start + 1024].float().to(self.device)
            output = self.model(x, self.loss_fn, self.cfg.sparsity.coeff)
            stats.add(output.stats)
            recon, l0 = recon + output.recon_loss.double(), l0 + output.l0.double()
        rows = torch.tensor(float(len(val_rows)), dtype=torch.float64)
        sums = {"recon_loss": recon, "l0": l0, "rows": rows}
        totals = self.groups.sum_tensors({k: v.to(self.device) for k, v in sums.items()})
        rows = max(float(totals.pop("rows")), 1.0)  # no validation rows: 0, not a ZeroDivision
        metrics = {f"val/{k}": float(v) / rows for k, v in totals.items()}
        metrics.update({f"val/{k}": v for k, v in stats.read(self.groups.sum_tensors).items()})
        decoder = full_tensor(self.plan.module.W_dec)  # a collective when sharded
        reconstruct = self.plan.inference_model.reconstruct
        metrics.update(self.data.metrics(decoder, lambda x: reconstruct(x.to(self.device))))
        self.model.train()
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

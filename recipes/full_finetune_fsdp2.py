"""Train a decoder LM: pretrain or fine-tune, on FSDP2 / ZeRO / DDP strategies; all of
its weights, or LoRA / QLoRA / DoRA adapters or Spectrum's modules (`peft:`); for int4
weights with torchao's quantization-aware training (`qat:`, docs/qat.md), exported
quantized at the end.

    freetx run --nproc-per-node 2 full_finetune_fsdp2 --config llm/tiny
    freetx run full_finetune_fsdp2 --config llm/tiny distributed.strategy=ddp max_steps=20
    freetx run --nproc-per-node 2 lora_finetune_fsdp2 --config llm/lora_tiny   # this file

The loop is in `train()`, top to bottom: fetch the micro-batches of one global
batch, forward + backward each (gradients normalized by the loss tokens of the
whole global batch, synced only on the last micro-batch), clip, step, schedule,
log, evaluate, checkpoint. `resume: auto` continues from the newest checkpoint
in output_dir. What every recipe shares is freetx's: the run's bookkeeping
(`TrainingRun`: checkpoints, resume, loggers, meters), parallelism
(`parallelize` -> a plan), data order. Copy this file (`freetx cp
full_finetune_fsdp2 ./my_ft.py`) to change the loop itself.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch
from omegaconf import MISSING

from freetx.checkpoint import files_read_by
from freetx.config import instantiate
from freetx.data import (
    TokenBatch,
    build_eval_loader,
    build_train_loader,
    checked_tokenizer,
    micro_batch_size,
    source_names,
)
from freetx.data.packing import packs
from freetx.distributed import build_groups, init_distributed, parallelize
from freetx.entry import parse
from freetx.errors import ConfigError
from freetx.evaluation import FinalTasks
from freetx.fields import read_path
from freetx.models.hf import model_dir_problems
from freetx.models.peft import PEFTConfig, apply_peft
from freetx.models.qat import QATConfig, apply_qat, set_fake_quantization
from freetx.objectives import loss_tokens
from freetx.training import (
    PlannedRun,
    TokenEvalConfig,
    TrainingConfig,
    TrainingRun,
    accumulate_gradients,
    build_lr_scheduler,
    check_context,
    check_model_and_data,
    check_packing,
    dataset_seq_len,
    evaluation_sums,
    first_batches_padding,
    optimizer_step,
    per_source_means,
    real_tokens,
    seed_everything,
)
from freetx.training.export import export_quantized_final


@dataclass
class FullFinetuneConfig(TrainingConfig):
    """The schema of this recipe's configs: TrainingConfig's keys (the run, its loop, the
    optimizer, schedule, parallelism, loggers), then these; a key not listed is an error."""

    fixed_on_resume: ClassVar[tuple[str, ...]] = (
        *TrainingConfig.fixed_on_resume, "model", "tokenizer", "dataset", "peft", "qat",
    )  # fmt: skip

    model_dir: Optional[str] = read_path(
        None
    )  # an HF model folder, for ${model_dir} in the sections below
    model: Any = MISSING
    tokenizer: Any = MISSING
    dataset: Any = MISSING  # built twice: split=train and split=validation
    loss: Any = field(default_factory=lambda: {"_component_": "freetx.objectives.CrossEntropyLoss"})
    eval: TokenEvalConfig = field(default_factory=TokenEvalConfig)
    peft: PEFTConfig = field(default_factory=PEFTConfig)  # LoRA / QLoRA / DoRA / Spectrum
    qat: QATConfig = field(default_factory=QATConfig)  # fake-quantized training (torchao)

    # a model_dir that cannot be a model (a text file, ...): said first, not as its
    # tokenizer's problem (one that does not exist: `check_read_paths`)
    meaningless = staticmethod(model_dir_problems)

    def refuse_combinations(self) -> None:
        """QAT under tensor parallelism: torchao's fake-quantized linears are not sliced."""
        if self.qat.scheme != "none" and self.distributed.tp > 1:
            raise ConfigError(
                f"qat.scheme={self.qat.scheme} fake-quantizes whole Linear layers, and "
                f"distributed.tp={self.distributed.tp} slices them over ranks.",
                fix="Set distributed.tp=1 (fsdp, zero or ddp train a QAT model), or qat.scheme=none.",
            )

    def planned(self) -> PlannedRun:  # sequences of the dataset's seq_len, with adapters
        return PlannedRun(
            self.model, dataset_seq_len(self), self.peft, self.loss, tokenizer=self.tokenizer,
            dataset=self.dataset,
        )  # fmt: skip


class FullFinetuneRecipeFSDP2:
    def __init__(self, cfg: FullFinetuneConfig) -> None:
        self.cfg = cfg
        self.runtime = init_distributed(cfg.device, cfg.distributed.collective_timeout_s)
        self.device = self.runtime.device
        self.accumulation = cfg.gradient_accumulation_steps
        seed_everything(cfg.seed, self.runtime.rank, cfg.deterministic)

    def setup(self) -> None:
        cfg = self.cfg
        self.groups = build_groups(self.runtime, cfg.distributed)  # the ranks: dp, world
        rank, world_size = self.groups.dp_rank, self.groups.dp_size  # this rank's share of data
        # Cheap checks first: a resume that would lose saved work or change fixed settings, a
        # bad batch split or data path fails before any model exists. (`peft:`: the LoRA recipe)
        name = "full_finetune_fsdp2" if cfg.peft.method == "none" else "lora_finetune_fsdp2"
        self.run = TrainingRun(cfg, self.groups, name)
        self.final_tasks = FinalTasks(cfg.eval, self.groups)  # eval.after_training's, checked
        micro_batch_size(cfg.batch_size, world_size, self.accumulation)
        self.tokenizer = checked_tokenizer(instantiate(cfg.tokenizer))
        self.loss_fn = instantiate(cfg.loss)  # its output layer in chunks: loss.num_chunks
        train_set = instantiate(cfg.dataset, tokenizer=self.tokenizer, split="train")
        val_set = instantiate(cfg.dataset, tokenizer=self.tokenizer, split="validation")
        self.run.report_cuts(train_set, val_set)  # samples cut or dropped at seq_len
        self.seq_len = train_set.seq_len
        collate = functools.partial(TokenBatch.collate, source_names=source_names(train_set))
        self.val_loader = build_eval_loader(val_set, cfg.eval.batch_size, rank, world_size, collate)

        with torch.device("meta"):
            model = instantiate(cfg.model)
        check_model_and_data(model.config, self.tokenizer, self.seq_len)
        check_packing(model, packs(train_set))  # a packed dataset needs a model that packs
        check_context(model, self.groups.shape, self.seq_len)  # cp: a part of each sequence
        trains = apply_peft(model, cfg.peft, world_size)  # all, or adapters / some modules
        apply_qat(model, cfg.qat)  # fake-quantized linears (qat.scheme), before FSDP2
        self.plan = parallelize(
            model, self.groups, cfg.distributed, seed=cfg.seed,
            init_weights=not self.run.loads_weights,  # random init unless weights are loaded
            frozen=self.run.decide_frozen_base(model),  # what is frozen, where it is read from
            micro_batches=self.accumulation,  # pp > 1: the pipeline's micro-batches
        )  # fmt: skip
        self.model = self.plan.model
        self.optimizer = self.plan.build_optimizer(cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.max_steps, cfg.lr_schedule)

        self.train_loader = build_train_loader(
            train_set, cfg.batch_size, self.accumulation, rank, world_size, cfg.seed,
            num_workers=cfg.num_workers, collate=collate,
        )  # fmt: skip
        self.run.start(
            self.plan, self.optimizer, self.lr_scheduler, self.train_loader,
            tokens_per_sample=self.seq_len, seq_len=self.seq_len,
            inputs=files_read_by(tokenizer=self.tokenizer, dataset=train_set),
            train_sequences=len(train_set), padding=first_batches_padding(self.train_loader),
            activation_checkpointing=cfg.distributed.activation_checkpointing, trains=trains,
        )  # fmt: skip

    def train(self) -> None:
        cfg, run = self.cfg, self.run
        data = iter(self.train_loader)
        self.model.train()
        while run.step < cfg.max_steps and not run.stopping:  # stopping: SIGTERM, ^C
            batches = [next(data) for _ in range(self.accumulation)]
            if cfg.qat.scheme != "none":  # fake quantization from qat.start_step on
                set_fake_quantization(self.model, run.step >= cfg.qat.start_step)
            self.optimizer.zero_grad(set_to_none=True)
            sums, num_tokens = accumulate_gradients(
                self.plan, batches, self.compute_loss, count=loss_tokens, loss=self.loss_fn
            )
            grad_norm = optimizer_step(
                self.plan, self.optimizer, self.lr_scheduler, cfg.max_grad_norm
            )
            # throughput counts real work: positions that are not padding, loss tokens
            run.advance(grad_norm, real_tokens(batches, self.groups), loss_tokens=num_tokens)
            if run.log_due():
                run.log_train(sums, num_tokens, grad_norm)
            if run.due(cfg.eval.every_n_steps):
                run.evaluate(self.evaluate)
            if run.due(cfg.checkpoint.every_n_steps):
                run.save()
        run.finish(self.evaluate)
        if cfg.qat.scheme != "none" and cfg.checkpoint.save_final and not run.stopping:
            run.checkpointer.wait()  # the final save is complete
            if self.runtime.is_rank_zero:  # from the saved checkpoint, as final_export
                for line in export_quantized_final(cfg.output_dir, cfg.qat):
                    run.write(line)
        self.final_tasks.run(self.plan, self.tokenizer, cfg.output_dir)  # lm-eval: eval.json

    def compute_loss(self, batch: TokenBatch):
        """One micro-batch: forward and the loss summed over its loss tokens (+ extras)."""
        return self.loss_fn(self.model, batch.input_ids, batch.labels, **batch.model_inputs())

    def evaluate(self) -> dict[str, float]:
        """Validation loss and perplexity over the whole split; every rank takes part."""
        self.model.eval()
        sums, tokens = {}, torch.zeros((), device=self.device)
        rows = self.cfg.batch_size // self.groups.dp_size  # pp: the stages' shapes
        for batch in itertools.islice(self.val_loader, self.cfg.eval.max_batches):  # None: all
            parts, loss_tokens = evaluation_sums(self.plan, batch, self.loss_fn, rows)
            for name, value in parts.items():
                sums[name] = sums.get(name, 0) + value
            tokens += loss_tokens
        totals = self.groups.sum({**sums, "tokens": tokens}, over="dp_cp")
        self.model.train()
        num_tokens = max(totals.pop("tokens"), 1.0)
        metrics = {f"val/{name}": value / num_tokens for name, value in totals.items()}
        metrics = per_source_means(metrics, prefix="val/")  # a mixture's: each source's
        metrics["val/perplexity"] = math.exp(min(metrics["val/loss"], 50.0))
        return metrics

    def cleanup(self) -> None:
        self.run.close()


@parse(FullFinetuneConfig)
def recipe_main(cfg: FullFinetuneConfig) -> None:
    recipe = FullFinetuneRecipeFSDP2(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())

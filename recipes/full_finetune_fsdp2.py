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
in output_dir. What every decoder recipe builds before its loop is one freetx setup
(`freetx.training.decoder.DecoderSetup`: the run, data, model, checks, PEFT, QAT,
parallelism, optimizer); what every recipe shares is freetx's: the run's bookkeeping
(`TrainingRun`: checkpoints, resume, loggers, meters), parallelism
(`parallelize` -> a plan), data order. Copy this file (`freetx cp
full_finetune_fsdp2 ./my_ft.py`) to change the loop itself.
"""

from __future__ import annotations

import functools
import itertools
import sys
from dataclasses import dataclass, field
from typing import Any

from freetx.config import instantiate
from freetx.data import TokenBatch, source_names
from freetx.data.packing import packs
from freetx.entry import parse
from freetx.training import (
    accumulate_gradients,
    first_batches_padding,
    optimizer_step,
    real_tokens,
    validation_means,
)
from freetx.training.decoder import DecoderConfig, DecoderSetup


@dataclass
class FullFinetuneConfig(DecoderConfig):
    """The schema of this recipe's configs: DecoderConfig's keys (the run, its loop, the
    optimizer, schedule, parallelism, loggers; the model, tokenizer, dataset, evaluation,
    `peft:` and `qat:`); a key not listed is an error."""

    loss: Any = field(default_factory=lambda: {"_component_": "freetx.objectives.CrossEntropyLoss"})


class FullFinetuneRecipeFSDP2:
    def __init__(self, cfg: FullFinetuneConfig) -> None:
        self.cfg = cfg
        self.accumulation = cfg.gradient_accumulation_steps

    def setup(self) -> None:
        cfg = self.cfg
        # Cheap checks first: a resume that would lose saved work or change fixed settings, a
        # bad batch split or data path fails before any model exists. (`peft:`: the LoRA recipe)
        name = "full_finetune_fsdp2" if cfg.peft.method == "none" else "lora_finetune_fsdp2"
        self.decoder = setup = DecoderSetup(cfg, name)
        self.run, self.groups, self.device = setup.run, setup.groups, setup.runtime.device
        self.loss_fn = instantiate(cfg.loss)  # its output layer in chunks: loss.num_chunks
        train_set, val_set = setup.datasets()  # samples cut or dropped at seq_len: said
        self.seq_len = train_set.seq_len
        # the model on the meta device, checked against the data (packing, cp's shards)
        model = setup.meta_model(cfg.model, self.seq_len, packed=packs(train_set))
        # PEFT, QAT, FSDP2 / DDP / ZeRO x tp / cp / pp / ep, optimizer, schedule
        self.plan = setup.build(model, micro_batches=self.accumulation)  # pp: its micro-batches
        self.model, self.optimizer = self.plan.model, setup.optimizer
        collate = functools.partial(TokenBatch.collate, source_names=source_names(train_set))
        self.train_loader, self.val_loader = setup.loaders(train_set, val_set, collate)
        setup.start(
            self.train_loader,
            train_set,
            tokens_per_sample=self.seq_len,
            seq_len=self.seq_len,
            train_sequences=len(train_set),
            padding=first_batches_padding(self.train_loader),
        )

    def train(self) -> None:
        cfg, run = self.cfg, self.run
        data = iter(self.train_loader)
        self.model.train()
        while run.step < cfg.max_steps and not run.stopping:  # stopping: SIGTERM, ^C
            batches = [next(data) for _ in range(self.accumulation)]
            self.optimizer.zero_grad(set_to_none=True)
            sums, num_tokens = accumulate_gradients(
                self.plan,
                batches,
                self.compute_loss,
                count=TokenBatch.loss_tokens,
                loss=self.loss_fn,
            )
            grad_norm = optimizer_step(
                self.plan, self.optimizer, self.decoder.lr_scheduler, cfg.max_grad_norm
            )
            # throughput counts real work: positions that are not padding, loss tokens
            run.advance(grad_norm, real_tokens(batches, self.groups), loss_tokens=num_tokens)
            if run.log_due():
                run.log_train(sums, num_tokens, grad_norm)
            if run.due(cfg.eval.every_n_steps):
                run.evaluate(self.evaluate)
            if run.due(cfg.checkpoint.every_n_steps):
                run.save()
        self.decoder.finish(self.evaluate)  # the last step's; QAT's export; lm-eval tasks

    def compute_loss(self, batch: TokenBatch):
        """One micro-batch: forward and the loss summed over its loss tokens (+ extras)."""
        return self.loss_fn(self.model, batch.input_ids, batch.labels, **batch.model_inputs())

    def evaluate(self) -> dict[str, float]:
        """Validation loss and perplexity over the whole split; every rank takes part."""
        self.model.eval()
        batches = itertools.islice(self.val_loader, self.cfg.eval.max_batches)  # None: all
        rows = self.cfg.batch_size // self.groups.dp_size  # pp: the stages' shapes
        metrics = validation_means(self.plan, batches, self.loss_fn, rows)
        self.model.train()
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

"""Train a decoder LM: pretrain or fine-tune, on FSDP2 / ZeRO / DDP strategies.

    freetx run --nproc-per-node 2 full_finetune_fsdp2 --config llm/tiny
    freetx run full_finetune_fsdp2 --config llm/tiny distributed.strategy=ddp max_steps=20

The loop is in `train()`, top to bottom: fetch the micro-batches of one global
batch, count their loss tokens over all ranks, forward + backward each (gradient
sync only on the last), clip, step, schedule, log, evaluate, checkpoint.
`resume: auto` continues from the newest checkpoint in output_dir. Everything shared
with other recipes (parallelism, data order, meters, loggers) is a freetx
function; copy this file (`freetx cp full_finetune_fsdp2 ./my_ft.py`) to change
the loop itself.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Optional

import torch
from omegaconf import MISSING, DictConfig

from freetx.checkpoint import (
    Checkpointer,
    TrainState,
    build_meta,
    training_state,
)
from freetx.config import at_least, instantiate, parse
from freetx.data import IGNORE_INDEX, build_eval_loader, build_train_loader, micro_batch_size
from freetx.distributed import (
    DistributedConfig,
    autocast,
    canonical_strategy,
    gradient_scaler,
    init_distributed,
    parallelize,
    unwrap,
)
from freetx.logging import build_metric_loggers, training_banner
from freetx.training import (
    LRScheduleConfig,
    ThroughputMeter,
    TrainingConfig,
    accumulate_gradients,
    build_lr_scheduler,
    build_optimizer,
    check_model_and_data,
    default_metric_loggers,
    optimizer_step,
    peak_flops,
    seed_everything,
    sum_over_ranks,
    train_step_metrics,
)


@dataclass
class EvalConfig:
    every_n_steps: int = at_least(0, default=0)  # 0: only at the end of training
    batch_size: int = at_least(1, default=8)  # sequences per rank per forward pass
    max_batches: Optional[int] = at_least(1, default=None)  # None: the whole validation split


@dataclass
class FullFinetuneConfig(TrainingConfig):
    """The schema of this recipe's configs (after TrainingConfig's run and loop keys);
    a key not listed is an error."""

    fixed_on_resume: ClassVar[tuple[str, ...]] = (
        *TrainingConfig.fixed_on_resume, "model", "tokenizer", "dataset",
    )  # fmt: skip

    model: Any = MISSING
    tokenizer: Any = MISSING
    dataset: Any = MISSING  # built twice: split=train and split=validation
    loss: Any = field(default_factory=lambda: {"_component_": "freetx.training.CrossEntropyLoss"})
    optimizer: Any = MISSING
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metric_loggers: list[Any] = field(default_factory=default_metric_loggers)


class FullFinetuneRecipeFSDP2:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.runtime = init_distributed(cfg.device)
        self.device = self.runtime.device
        self.world_size = self.runtime.world_size
        self.strategy = canonical_strategy(cfg.distributed.strategy)
        self.accumulation = cfg.gradient_accumulation_steps
        seed_everything(cfg.seed, self.runtime.rank)
        self.progress = TrainState()  # step, epoch, tokens seen: saved with every checkpoint

    def setup(self) -> None:
        cfg, rank = self.cfg, self.runtime.rank
        # Cheap checks first: a bad batch split, a resume that would lose saved work or
        # change fixed settings, or a bad data path fails before any model exists.
        self.checkpointer = Checkpointer(cfg, rank)
        self.micro_batch = micro_batch_size(cfg.batch_size, self.world_size, self.accumulation)
        self.tokenizer = instantiate(cfg.tokenizer)
        train_set = instantiate(cfg.dataset, tokenizer=self.tokenizer, split="train")
        val_set = instantiate(cfg.dataset, tokenizer=self.tokenizer, split="validation")
        self.seq_len = train_set.seq_len

        with torch.device("meta"):
            model = instantiate(cfg.model)
        check_model_and_data(model.config, self.tokenizer, self.seq_len)
        self.model = parallelize(model, self.runtime, cfg.distributed, seed=cfg.seed)
        self.optimizer = build_optimizer(cfg.optimizer, self.model, self.strategy, self.device)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.max_steps, cfg.lr_schedule)
        self.loss_fn = instantiate(cfg.loss)
        self.scaler = gradient_scaler(self.runtime, cfg.distributed)

        self.train_loader = build_train_loader(
            train_set, cfg.batch_size, self.accumulation, rank, self.world_size, cfg.seed,
            num_workers=cfg.num_workers,
        )  # fmt: skip
        self.val_loader = build_eval_loader(val_set, cfg.eval.batch_size, rank, self.world_size)

        self.loggers = build_metric_loggers(cfg.metric_loggers, cfg.output_dir, cfg.max_steps, rank)
        self.meter = ThroughputMeter(
            unwrap(self.model).flops_per_token(self.seq_len),
            self.world_size,
            peak_flops(self.device, cfg.peak_flops),
        )
        self.loggers.write(
            training_banner(
                "full_finetune_fsdp2", self.runtime, self.strategy, cfg,
                seq_len=self.seq_len, parameters=unwrap(self.model).num_parameters(),
                train_sequences=len(train_set),
                activation_checkpointing=cfg.distributed.activation_checkpointing,
            )
        )  # fmt: skip
        self.setup_checkpointing(model.config)

    def setup_checkpointing(self, model_config) -> None:
        """Resume from a checkpoint, or start from initial weights, or from scratch."""
        meta = build_meta(unwrap(self.model), asdict(model_config), self.world_size, self.strategy)
        self.state = training_state(
            self.model, self.optimizer, self.lr_scheduler, self.progress, self.train_loader,
            self.runtime.rank,
        )  # fmt: skip
        message = self.checkpointer.restore(self.state, self.model, meta)
        if message:
            self.loggers.write(message)
        self.saved_step = self.progress.step
        self.evaluated_step = None

    def train(self) -> None:
        cfg = self.cfg
        data = iter(self.train_loader)
        self.model.train()
        while self.progress.step < cfg.max_steps:
            batches = [next(data) for _ in range(self.accumulation)]
            self.optimizer.zero_grad(set_to_none=True)
            sums, num_tokens = accumulate_gradients(
                self.model, batches, self.compute_loss, self.runtime, cfg.distributed, self.scaler
            )
            grad_norm = optimizer_step(
                self.model, self.optimizer, self.scaler, self.lr_scheduler, cfg.max_grad_norm
            )
            self.progress.step += 1
            self.progress.epoch = self.train_loader.batch_sampler.epoch
            self.progress.tokens_seen += cfg.batch_size * self.seq_len
            self.meter.update(cfg.batch_size * self.seq_len)  # tokens processed

            step = self.progress.step
            if step % cfg.log_every_n_steps == 0 or step == cfg.max_steps:
                self.log_train_metrics(sums, num_tokens, grad_norm)
            if cfg.eval.every_n_steps and step % cfg.eval.every_n_steps == 0:
                self.loggers.log(step, self.evaluate())
                self.evaluated_step = step
            if cfg.checkpoint.every_n_steps and step % cfg.checkpoint.every_n_steps == 0:
                self.save_checkpoint()
        if self.evaluated_step != self.progress.step:  # also after a resume with nothing to train
            self.loggers.log(self.progress.step, self.evaluate())
        if cfg.checkpoint.save_final and self.saved_step != self.progress.step:
            self.save_checkpoint()

    def save_checkpoint(self) -> None:
        """A sharded DCP save of everything needed to resume (every rank takes part)."""
        self.checkpointer.save(
            self.progress.step, self.state, {"tokens_seen": self.progress.tokens_seen}
        )
        self.saved_step = self.progress.step

    def compute_loss(self, batch: dict[str, torch.Tensor]):
        """One micro-batch: forward, then the loss summed over its loss tokens (+ extras)."""
        output = self.model(batch["input_ids"].to(self.device))
        return self.loss_fn(output, batch["labels"].to(self.device))

    def log_train_metrics(
        self, sums: dict[str, torch.Tensor], num_tokens: torch.Tensor, grad_norm: float
    ) -> None:
        metrics = train_step_metrics(
            sums, num_tokens, grad_norm, self.lr_scheduler, self.meter, self.device
        )
        metrics["tokens_seen"] = self.progress.tokens_seen
        self.loggers.log(self.progress.step, metrics)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation loss and perplexity over the whole split; every rank takes part."""
        self.model.eval()
        sums = {"loss": torch.zeros((), device=self.device)}
        tokens = torch.zeros((), device=self.device)
        for i, batch in enumerate(self.val_loader):
            if self.cfg.eval.max_batches is not None and i >= self.cfg.eval.max_batches:
                break
            input_ids = batch["input_ids"].to(self.device)
            labels = batch["labels"].to(self.device)
            with autocast(self.model, self.runtime, self.cfg.distributed):
                loss, parts = self.loss_fn.evaluate(self.model, input_ids, labels)
            sums["loss"] += loss
            for name, value in parts.items():
                sums[name] = sums.get(name, 0) + value
            tokens += (labels != IGNORE_INDEX).sum()
        totals = sum_over_ranks({**sums, "tokens": tokens}, self.device)
        self.model.train()
        num_tokens = max(totals.pop("tokens"), 1.0)
        metrics = {f"val/{name}": value / num_tokens for name, value in totals.items()}
        metrics["val/perplexity"] = math.exp(min(metrics["val/loss"], 50.0))
        return metrics

    def cleanup(self) -> None:
        self.checkpointer.close()  # waits for an asynchronous save to finish
        self.loggers.close()


@parse(FullFinetuneConfig)
def recipe_main(cfg: DictConfig) -> None:
    recipe = FullFinetuneRecipeFSDP2(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())

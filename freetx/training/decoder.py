"""One setup for every decoder recipe (full_finetune_fsdp2 and its LoRA twin, dpo_fsdp2,
kd_fsdp2, grpo_fsdp2): their schema's common keys (`DecoderConfig`) and what they build
before their loop (`DecoderSetup`), written once; a recipe keeps its objective and its loop.

    setup = DecoderSetup(cfg, "dpo_fsdp2")          # process, groups, run, tokenizer
    train_set, val_set = setup.datasets()           # both splits, their cuts reported
    model = setup.meta_model(cfg.model, seq_len, packed=packs(train_set))   # every check
    plan = setup.build(model)                       # PEFT, QAT, parallelize, optimizer, schedule
    train_loader, val_loader = setup.loaders(train_set, val_set, collate)
    setup.start(train_loader, tokens_per_sample=2 * seq_len, ...)   # banner, resume
    ...the recipe's loop, with setup.run...
    setup.finish(recipe.evaluate)                   # last evaluation and save, exports, lm-eval

A cross-cutting feature of the decoder recipes (QAT's fake quantization from
`qat.start_step`, `eval.after_training`, a check of model against data) is added here once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch
from omegaconf import MISSING
from torch import nn

from freetx.checkpoint import files_read_by
from freetx.config import instantiate
from freetx.data import (
    build_eval_loader,
    build_train_loader,
    checked_tokenizer,
    micro_batch_size,
)
from freetx.data.formats import SkipsBadRows
from freetx.data.mixture import MadeOfParts, summary_lines
from freetx.data.seq_len import CutsToSeqLen
from freetx.data.token_cache import UsesTokenCache
from freetx.distributed import ParallelPlan, build_groups, init_distributed, parallelize
from freetx.errors import ConfigError
from freetx.evaluation import FinalTasks
from freetx.fields import read_path
from freetx.models.hf import model_dir_problems
from freetx.models.peft import PEFTConfig, apply_peft
from freetx.models.qat import QATConfig, apply_qat, set_fake_quantization
from freetx.training.checks import (
    check_context,
    check_model_and_data,
    check_packing,
    check_read_paths,
    dataset_seq_len,
    holds_validation,
)
from freetx.training.config import PlannedRun, TokenEvalConfig, TrainingConfig
from freetx.training.export import export_quantized_final
from freetx.training.lifecycle import TrainingRun
from freetx.training.lr_schedule import build_lr_scheduler
from freetx.training.seed import seed_everything


@dataclass
class DecoderConfig(TrainingConfig):
    """The keys every decoder recipe's schema has beside TrainingConfig's: the model (an HF
    folder's, by `model_dir`), its tokenizer, the dataset (built twice: split=train and
    split=validation), the loss, the evaluation, what trains (`peft:`) and quantization-aware
    training (`qat:`). A recipe's schema subclasses it, giving `loss` its default."""

    fixed_on_resume: ClassVar[tuple[str, ...]] = (
        *TrainingConfig.fixed_on_resume,
        "model",
        "tokenizer",
        "dataset",
        "peft",
        "qat",
    )

    model_dir: Optional[str] = read_path(None)  # an HF model folder, for ${model_dir} below
    model: Any = MISSING
    tokenizer: Any = MISSING
    dataset: Any = MISSING
    loss: Any = MISSING
    eval: TokenEvalConfig = field(default_factory=TokenEvalConfig)
    peft: PEFTConfig = field(default_factory=PEFTConfig)  # LoRA / QLoRA / DoRA / Spectrum
    qat: QATConfig = field(default_factory=QATConfig)  # fake-quantized training (torchao)

    # a model_dir that cannot be a model (a text file, ...): said first, not as its
    # tokenizer's problem (one that does not exist: `check_read_paths`)
    meaningless = staticmethod(model_dir_problems)

    def planned(self) -> PlannedRun:
        """Sequences of the dataset's seq_len, with the adapters (`freetx estimate`,
        `check_layout`); a recipe whose samples are otherwise (pairs, prompts) says so."""
        return PlannedRun(
            self.model, dataset_seq_len(self), self.peft, self.loss, tokenizer=self.tokenizer,
            dataset=self.dataset,
        )  # fmt: skip

    def refuse_combinations(self) -> None:
        """QAT under tensor parallelism: torchao's fake-quantized linears are not sliced;
        QAT whose fake quantization starts after the last step: it would never train; an
        evaluation every n steps of a dataset that holds no validation rows."""
        if self.eval.every_n_steps and not holds_validation(self.dataset):
            raise ConfigError(
                "dataset.val_fraction=0 holds no rows out for validation and no "
                f"dataset.validation_source is set, so eval.every_n_steps={self.eval.every_n_steps} "
                "has nothing to evaluate.",
                fix="Set eval.every_n_steps=0 (no validation: every row trains), give the "
                "validation rows as dataset.validation_source=FILE, or hold some out with "
                "dataset.val_fraction=0.05.",
            )
        if self.qat.scheme == "none":
            return
        if self.distributed.tp > 1:
            raise ConfigError(
                f"qat.scheme={self.qat.scheme} fake-quantizes whole Linear layers, and "
                f"distributed.tp={self.distributed.tp} slices them over ranks.",
                fix="Set distributed.tp=1 (fsdp, zero or ddp train a QAT model), or qat.scheme=none.",
            )
        if self.qat.start_step >= self.max_steps:
            raise ConfigError(
                f"qat.start_step={self.qat.start_step} turns fake quantization on after "
                f"{self.qat.start_step} steps, and the run stops after max_steps="
                f"{self.max_steps}: no step would train through it, and the quantized export "
                "would be plain post-training quantization labelled QAT.",
                fix=f"Set qat.start_step below {self.max_steps} (0: from the first step), raise "
                "max_steps, or set qat.scheme=none (and quantize after training with `freetx "
                "checkpoint convert --quantize`).",
            )


class DecoderSetup:
    """What a decoder recipe builds before its loop, step by step (the module docstring);
    the recipe reads what it needs from it: `runtime`, `groups`, `run`, `tokenizer`, `plan`,
    `model`, `optimizer`, `lr_scheduler`."""

    def __init__(self, cfg: DecoderConfig, recipe: str) -> None:
        """The process and its seed, the ranks by axis, the run (which refuses a resume that
        would lose saved work before anything is built), `eval.after_training`'s tasks,
        the split of the global batch, and the tokenizer: every cheap check first (a file
        the run reads that is not there, named by its key: a teacher's weights)."""
        cfg.refuse_combinations()
        check_read_paths(cfg)
        self.cfg = cfg
        self.runtime = init_distributed(cfg.device, cfg.distributed.collective_timeout_s)
        seed_everything(cfg.seed, self.runtime.rank, cfg.deterministic)
        self.groups = build_groups(self.runtime, cfg.distributed)  # the ranks: dp, world
        self.run = TrainingRun(cfg, self.groups, recipe)
        self.final_tasks = FinalTasks(cfg.eval, self.groups)  # eval.after_training's, checked
        micro_batch_size(cfg.batch_size, self.groups.dp_size, cfg.gradient_accumulation_steps)
        self.tokenizer = checked_tokenizer(instantiate(cfg.tokenizer))
        self.trains = "all"
        self.validates = True  # `datasets` says: False when the data holds no validation rows

    def datasets(self):
        """The dataset's train and validation splits (None when it holds no validation rows:
        `holds_validation`; the run then evaluates nothing); the console says what they are
        made of and what was cut at seq_len, cached, or skipped."""
        cfg = self.cfg
        train_set = instantiate(cfg.dataset, tokenizer=self.tokenizer, split="train")
        self.validates = holds_validation(cfg.dataset)
        val_set = None
        if self.validates:
            val_set = instantiate(cfg.dataset, tokenizer=self.tokenizer, split="validation")
        for line in data_report(*(d for d in (train_set, val_set) if d is not None)):
            self.run.write(line)
        if not self.validates:
            self.run.write(
                "no validation: dataset.val_fraction=0 and no dataset.validation_source; "
                "every row trains and nothing is evaluated"
            )
        return train_set, val_set

    def meta_model(
        self,
        node: Any,
        seq_len: int,
        packed: bool = False,
        tokenizer=None,
        seq_key: str = "dataset.seq_len",
    ):
        """The model a node builds, on the meta device, checked against its data before any
        weight exists: the tokenizer's ids (`tokenizer`, else the run's) fit its embedding,
        `seq_len` (the config's `seq_key`) its positions; a packed dataset needs a model
        that packs; context parallelism, a model that computes a part of each sequence."""
        with torch.device("meta"):
            model = instantiate(node)
        check_model_and_data(model.config, tokenizer or self.tokenizer, seq_len, seq_key)
        check_packing(model, packed)
        check_context(model, self.groups.shape, seq_len)
        return model

    def build(self, model: nn.Module, micro_batches: int = 1) -> ParallelPlan:
        """What trains (`peft:`: all, adapters, or some modules) and QAT's fake quantizers on
        the meta model, then its parallel plan (initialized at random unless weights are
        loaded), the optimizer and the learning-rate schedule. `micro_batches`: a pipeline's
        per step (pp > 1)."""
        cfg = self.cfg
        self.trains = apply_peft(model, cfg.peft, self.groups.dp_size)
        apply_qat(model, cfg.qat)  # before FSDP2: fake-quantized linears (qat.scheme)
        self.plan = parallelize(
            model,
            self.groups,
            cfg.distributed,
            seed=cfg.seed,
            init_weights=not self.run.loads_weights,  # random init unless weights are loaded
            frozen=self.run.decide_frozen_base(model),  # what is frozen, where it is read from
            micro_batches=micro_batches,
        )
        self.model = self.plan.model
        self.optimizer = self.plan.build_optimizer(cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.max_steps, cfg.lr_schedule)
        return self.plan

    def loaders(self, train_set, val_set, collate: Callable, micro_batches: int | None = None):
        """This rank's training batches (`micro_batches` per optimizer step: by default
        gradient_accumulation_steps) in the order of the seed, and its share of the
        validation split (eval.batch_size over all ranks; None without one)."""
        cfg, rank, size = self.cfg, self.groups.dp_rank, self.groups.dp_size
        micro_batches = cfg.gradient_accumulation_steps if micro_batches is None else micro_batches
        train = build_train_loader(
            train_set,
            cfg.batch_size,
            micro_batches,
            rank,
            size,
            cfg.seed,
            num_workers=cfg.num_workers,
            collate=collate,
        )
        if val_set is None:  # no validation rows
            return train, None
        return train, build_eval_loader(val_set, cfg.eval.batch_size, rank, size, collate)

    def start(
        self, train_loader, train_set, tokens_per_sample: int, models=None, **facts: Any
    ) -> None:
        """Everything is built: the banner (`facts`), the resume or the initial weights,
        config.yaml (`TrainingRun.start`); what the run reads is recorded by identity and
        checked on resume: the files of the tokenizer and of `train_set`, and `models` (name
        -> path: a teacher, a reference; None: not read). QAT's fake quantization follows the
        step from here on (off before `qat.start_step`)."""
        cfg = self.cfg
        read = {name: path for name, path in (models or {}).items() if path}
        inputs = {**read, **files_read_by(tokenizer=self.tokenizer, dataset=train_set)}
        self.run.start(
            self.plan,
            self.optimizer,
            self.lr_scheduler,
            train_loader,
            tokens_per_sample=tokens_per_sample,
            inputs=inputs,
            **facts,
            activation_checkpointing=cfg.distributed.activation_checkpointing,
            trains=self.trains,
        )
        if cfg.qat.scheme != "none":
            self.run.each_step(
                lambda step: set_fake_quantization(self.model, step >= cfg.qat.start_step)
            )

    def finish(self, evaluate: Callable[[], dict[str, float]]) -> None:
        """After the loop: the last evaluation and save, `checkpoint.final_export`
        (`TrainingRun.finish`); a QAT run's final checkpoint quantized into
        output_dir/export/quantized; `eval.after_training`'s lm-eval tasks (eval.json)."""
        cfg, run = self.cfg, self.run
        run.finish(evaluate if self.validates else None)
        if cfg.qat.scheme != "none" and cfg.checkpoint.save_final and not run.stopping:
            run.checkpointer.wait()  # the final save is complete
            if self.runtime.is_rank_zero:  # from the saved checkpoint, as final_export
                for line in export_quantized_final(cfg.output_dir, cfg.qat):
                    run.write(line)
        self.final_tasks.run(self.plan, self.tokenizer, cfg.output_dir)


def data_report(*datasets) -> list[str]:
    """What a run's datasets are, for the console: what the first (the training split) is
    made of (samples -> sequences of seq_len, padding, packed or not: `summary_lines`); how
    a mixture mixes; then for each dataset (a mixture's sources each) what the token cache
    did (reused, built, or why not cached), how many samples were cut at seq_len and how many
    were left with no loss tokens (dropped), and the bad rows a read skipped
    (`dataset.on_bad_row=skip`); a line two splits share, once."""
    lines = summary_lines(datasets[0]) if datasets else []
    lines += [d.line() for d in datasets if isinstance(d, MadeOfParts)]
    parts = [p for d in datasets for p in (d.parts if isinstance(d, MadeOfParts) else (d,))]
    cached = [d.token_cache for d in parts if isinstance(d, UsesTokenCache)]
    lines += [cache.line() for cache in cached if not cache.builtin]
    lines += [d.fit.line() for d in parts if isinstance(d, CutsToSeqLen) and d.fit.cut]
    skipped = [d.bad_rows for d in parts if isinstance(d, SkipsBadRows)]
    lines += [rows.line() for rows in skipped if rows.skipped]
    return list(dict.fromkeys(lines))  # text's one cache entry for both splits: once

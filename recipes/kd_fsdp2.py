"""Knowledge distillation: a student decoder learns a frozen teacher's next-token
distribution and the labels; all of the student's weights, or LoRA / QLoRA / DoRA
adapters (`peft:`), on FSDP2 / ZeRO / DDP strategies with tp.

    freetx run --nproc-per-node 2 full_finetune_fsdp2 --config llm/kd_teacher_tiny  # the teacher
    freetx run --nproc-per-node 2 kd_fsdp2 --config llm/kd_tiny
    freetx run --nproc-per-node 2 kd_fsdp2 --config llm/hf_tiny_kd model_dir=STUDENT teacher_dir=TEACHER

The loop is full_finetune_fsdp2's, top to bottom in `train()`; only the loss differs
(`Distill`): each micro-batch goes through the teacher first (frozen, sharded like the
student by `parallelize_frozen`, no gradients or optimizer state), which hands back its
last hidden states and output layer (`TeacherTokens`); then through the student, whose
output layer and the teacher's make both models' logits a chunk of tokens at a time
inside the loss (`freetx.objectives.DistillationLoss`: ce_weight x cross-entropy +
kd_weight x forward KL, reverse KL or JSD at a temperature), never two whole
[batch, seq, vocab] tensors. The teacher and the student must share a vocabulary
(checked before anything is built). Copy this file (`freetx cp kd_fsdp2 ./my_kd.py`)
to change the loop itself.
"""

from __future__ import annotations

import functools
import itertools
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

from omegaconf import MISSING, OmegaConf

from freetx.checkpoint import input_identity
from freetx.config import instantiate
from freetx.data import DistillBatch, checked_tokenizer, source_names
from freetx.data.packing import packs
from freetx.entry import parse
from freetx.errors import ConfigError
from freetx.fields import at_least, read_path
from freetx.objectives.distillation import (
    Distill,
    check_same_vocabulary,
    check_top_k,
    with_teacher_top_k,
)
from freetx.objectives.reference import FrozenCopy
from freetx.training import (
    accumulate_gradients,
    first_batches_padding,
    model_vocab_size,
    optimizer_step,
    real_tokens,
    validation_means,
)
from freetx.training.decoder import DecoderConfig, DecoderSetup


@dataclass
class TeacherConfig:
    """The frozen teacher: its model, its weights and its tokenizer (for the vocabulary
    check: the student's and the teacher's must be the same)."""

    model: Any = MISSING  # a model node, e.g. {_component_: freetx.models.hf_model, path: ...}
    weights: Optional[str] = read_path(None)  # an HF folder, a run's output_dir, a DCP folder
    tokenizer: Any = None  # None: the student's
    # top_k: the teacher's top_k log-probs per position computed once before training, kept
    # in output_dir/teacher_topk, and the teacher freed (forward KL at temperature 1 only)
    precompute: Literal["none", "top_k"] = "none"
    top_k: int = at_least(1, default=64)


@dataclass
class KDConfig(DecoderConfig):
    """The schema of this recipe's configs: DecoderConfig's keys, then these."""

    fixed_on_resume: ClassVar[tuple[str, ...]] = (
        *DecoderConfig.fixed_on_resume,
        "teacher",
        "loss",
    )

    teacher_dir: Optional[str] = read_path(None)  # the teacher's HF folder, for ${teacher_dir}
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    loss: Any = field(default_factory=lambda: {"_component_": "freetx.objectives.DistillationLoss"})

    def refuse_combinations(self) -> None:
        """Pipeline parallelism: the teacher's hidden states would have to reach the
        student's last stage. A precomputed teacher: whole sequences (no cp), and a loss
        its top-k can give (forward KL at temperature 1), and a top_k its vocabulary has.
        And DecoderConfig's (QAT with tp or past max_steps, an evaluation without validation
        rows)."""
        super().refuse_combinations()
        if self.distributed.pp > 1:
            raise ConfigError(
                f"distributed.pp={self.distributed.pp}: kd_fsdp2 runs no pipeline (the "
                "teacher's last hidden states are needed where the student's loss is, at its "
                "last stage).",
                fix="Use distributed.tp or a sharded strategy instead, with pp=1.",
            )
        if self.teacher.precompute == "none":
            return
        if self.distributed.cp > 1:
            raise ConfigError(
                f"teacher.precompute=top_k keeps the teacher's top-k per position of whole "
                f"sequences, and distributed.cp={self.distributed.cp} splits each sequence.",
                fix="Set distributed.cp=1, or teacher.precompute=none (the live teacher).",
            )
        check_top_k(self.teacher.top_k, model_vocab_size(self.teacher.model))
        loss = dict(self.loss)
        if loss.get("divergence", "forward_kl") != "forward_kl" or loss.get("temperature", 1) != 1:
            raise ConfigError(
                "teacher.precompute=top_k keeps the teacher's top-k log-probs at temperature 1, "
                "which only forward KL at temperature 1 can be taken over; the loss has "
                f"divergence={loss.get('divergence')}, temperature={loss.get('temperature')}.",
                fix="Set loss.divergence=forward_kl loss.temperature=1.0, or use the live "
                "teacher (teacher.precompute=none).",
            )


class KDRecipeFSDP2:
    def __init__(self, cfg: KDConfig) -> None:
        self.cfg = cfg
        self.accumulation = cfg.gradient_accumulation_steps

    def setup(self) -> None:
        cfg = self.cfg
        self.decoder = setup = DecoderSetup(cfg, "kd_fsdp2")  # the run, ranks, tokenizer
        self.run, self.groups, self.device = setup.run, setup.groups, setup.runtime.device
        teacher_tokenizer = (
            setup.tokenizer
            if cfg.teacher.tokenizer is None
            else checked_tokenizer(instantiate(cfg.teacher.tokenizer))
        )
        train_set, val_set = setup.datasets()
        self.seq_len = train_set.seq_len
        # the student and the teacher's shape on the meta device, each checked against the
        # data; their vocabularies must be one
        packed = packs(train_set)
        model = setup.meta_model(cfg.model, self.seq_len, packed)
        shape = setup.meta_model(cfg.teacher.model, self.seq_len, packed, teacher_tokenizer)
        check_same_vocabulary(
            setup.tokenizer, teacher_tokenizer, model.config.vocab_size, shape.config.vocab_size
        )
        self.plan = setup.build(model)  # PEFT, QAT, parallelize, optimizer, schedule
        self.model, self.optimizer = self.plan.model, setup.optimizer
        distill = instantiate(cfg.loss)
        teacher = FrozenCopy.build(
            cfg.teacher.model, self.plan, cfg.seed, cfg.teacher.weights, distill.num_chunks
        )
        if cfg.teacher.precompute == "top_k":  # computed once, then the teacher is freed
            train_set, val_set = self.precomputed(teacher, train_set, val_set)
            teacher = None
        self.loss_fn = Distill(distill, teacher)

        names = source_names(train_set)
        collate = functools.partial(DistillBatch.collate_teacher, source_names=names)
        self.train_loader, self.val_loader = setup.loaders(train_set, val_set, collate)
        setup.start(
            self.train_loader,
            train_set,
            tokens_per_sample=self.seq_len,
            seq_len=self.seq_len,
            models={"teacher": cfg.teacher.weights},
            train_sequences=len(train_set),
            padding=first_batches_padding(self.train_loader),
            teacher=cfg.teacher.weights or f"random (seed {cfg.seed})",
        )

    def precomputed(self, teacher: FrozenCopy, *datasets):
        """The datasets with the teacher's top-k per position (`with_teacher_top_k`):
        computed once by the ranks together, or read from output_dir/teacher_topk when
        made for the same data, k and teacher."""
        cfg, weights = self.cfg, self.cfg.teacher.weights
        identity = {
            "teacher": input_identity(weights)["fingerprint"] if weights else f"seed {cfg.seed}",
            "teacher_model": OmegaConf.to_container(cfg.teacher.model, resolve=True),
        }
        batch, k, out = cfg.eval.batch_size, cfg.teacher.top_k, cfg.output_dir
        splits = zip(datasets, ("train", "validation"))
        return [
            with_teacher_top_k(teacher, d, split, identity, out, batch, k, self.run.write)
            if d is not None  # None: no validation split
            else None
            for d, split in splits
        ]

    def train(self) -> None:
        cfg, run = self.cfg, self.run
        data = iter(self.train_loader)
        self.model.train()
        while run.step < cfg.max_steps and not run.stopping:  # stopping: SIGTERM, ^C
            batches = [next(data) for _ in range(self.accumulation)]
            self.optimizer.zero_grad(set_to_none=True)
            sums, num_tokens = accumulate_gradients(
                self.plan, batches, self.compute_loss, count=DistillBatch.loss_tokens
            )
            grad_norm = optimizer_step(
                self.plan, self.optimizer, self.decoder.lr_scheduler, cfg.max_grad_norm
            )
            run.advance(grad_norm, real_tokens(batches, self.groups), loss_tokens=num_tokens)
            if run.log_due():
                run.log_train(sums, num_tokens, grad_norm)
            if run.due(cfg.eval.every_n_steps):
                run.evaluate(self.evaluate)
            if run.due(cfg.checkpoint.every_n_steps):
                run.save()
        self.decoder.finish(self.evaluate)  # the last step's; QAT's export; lm-eval tasks

    def compute_loss(self, batch: DistillBatch):
        """One micro-batch: the teacher's forward, then the student's with the KD loss."""
        return self.loss_fn(self.model, batch.input_ids, batch.labels, **batch.model_inputs())

    def evaluate(self) -> dict[str, float]:
        """The validation loss and its parts per loss token (`val/ce`: the student's
        cross-entropy of the labels, and its perplexity); every rank takes part."""
        self.model.eval()
        batches = itertools.islice(self.val_loader, self.cfg.eval.max_batches)  # None: all
        rows = self.cfg.batch_size // self.groups.dp_size
        metrics = validation_means(self.plan, batches, self.loss_fn, rows, perplexity_of="ce")
        self.model.train()
        return metrics

    def cleanup(self) -> None:
        self.run.close()


@parse(KDConfig)
def recipe_main(cfg: KDConfig) -> None:
    recipe = KDRecipeFSDP2(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())

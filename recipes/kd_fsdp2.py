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
(checked before anything is built).

On-policy distillation (`on_policy.lmbda`, TRL GKD's: the share of steps): on such a
step each row keeps its prompt and the student samples its completion
(`freetx.objectives.on_policy.StudentSamples`, the generation engine, draws keyed by the
seed, the step and the row), and the teacher scores every sampled token:

    freetx run --nproc-per-node 2 kd_fsdp2 --config llm/on_policy_kd_tiny

Copy this file (`freetx cp kd_fsdp2 ./my_kd.py`) to change the loop itself.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

from omegaconf import MISSING, OmegaConf

from freetx.checkpoint import input_identity
from freetx.config import instantiate
from freetx.data import (
    ChatDataset,
    DistillBatch,
    InstructDataset,
    checked_tokenizer,
    source_names,
)
from freetx.data.packing import packs
from freetx.entry import parse
from freetx.errors import ConfigError
from freetx.fields import at_least, read_path
from freetx.models.engine import check_pool
from freetx.models.generation import check_generates
from freetx.models.hf import ending_ids
from freetx.objectives.distillation import (
    Distill,
    check_same_vocabulary,
    check_top_k,
    with_teacher_top_k,
)
from freetx.objectives.on_policy import OnPolicyConfig, StudentSamples
from freetx.objectives.reference import FrozenCopy
from freetx.training import (
    PlannedRun,
    accumulate_gradients,
    first_batches_padding,
    model_vocab_size,
    optimizer_step,
    real_tokens,
    validation_means,
)
from freetx.training.checks import dataset_nodes, dataset_seq_len
from freetx.training.decoder import DecoderConfig, DecoderSetup
from freetx.training.export import built_class


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
        "on_policy",
    )

    teacher_dir: Optional[str] = read_path(None)  # the teacher's HF folder, for ${teacher_dir}
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    loss: Any = field(default_factory=lambda: {"_component_": "freetx.objectives.DistillationLoss"})
    # the student's own completions (GKD): the share of steps, their sampling, validation
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)

    def refuse_combinations(self) -> None:
        """Pipeline parallelism: the teacher's hidden states would have to reach the
        student's last stage. A precomputed teacher: whole sequences (no cp), and a loss
        its top-k can give (forward KL at temperature 1), and a top_k its vocabulary has.
        The student's samples: no precomputed teacher, packing or cp, a KV cache pool that
        holds a completion. And DecoderConfig's (QAT with tp or past max_steps, an
        evaluation without validation rows)."""
        super().refuse_combinations()
        if self.distributed.pp > 1:
            raise ConfigError(
                f"distributed.pp={self.distributed.pp}: kd_fsdp2 runs no pipeline (the "
                "teacher's last hidden states are needed where the student's loss is, at its "
                "last stage).",
                fix="Use distributed.tp or a sharded strategy instead, with pp=1.",
            )
        if self.on_policy.samples:
            self.refuse_for_samples()
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

    def planned(self) -> PlannedRun:
        """DecoderConfig's; with the student's samples, rows of a prompt and a completion,
        generated with every parameter gathered and a KV cache (`freetx estimate`)."""
        found = super().planned()
        if not self.on_policy.samples:
            return found
        seq_len = dataset_seq_len(self) + self.on_policy.max_completion_length
        return dataclasses.replace(
            found, seq_len=seq_len, generations_per_prompt=1, engine=self.on_policy.engine
        )

    def refuse_for_samples(self) -> None:
        """What the student's samples (`on_policy`) cannot run with: the first of them
        refused, with its fix."""
        found = []  # (why, fix)
        if self.teacher.precompute != "none":
            found.append((
                "teacher.precompute=top_k keeps the teacher's top-k on the data's tokens, and "
                "the student's samples are new tokens the teacher must score",
                "Set teacher.precompute=none (the live teacher).",
            ))  # fmt: skip
        for node in dataset_nodes(self.dataset):
            target = built_class(node, "dataset")
            if target and not issubclass(target, (InstructDataset, ChatDataset)):
                found.append((
                    f"dataset {target.__name__} has no prompts (its rows are labelled from "
                    "their first token), and a sample answers a row's prompt",
                    "Use freetx.data.InstructDataset or freetx.data.ChatDataset (a prompt, "
                    "then the answer the student's sample replaces).",
                ))  # fmt: skip
            if node.get("packed"):
                found.append((
                    "packed=true packs several examples into a row, and a sample replaces a "
                    "row's completion after its prompt",
                    "Set dataset.packed=false (a mixture's: each source's packed=false).",
                ))  # fmt: skip
        if self.distributed.cp > 1:
            found.append((
                f"distributed.cp={self.distributed.cp} splits each sequence, and the KV cache "
                "that samples holds no context shard",
                "Set distributed.cp=1 (distributed.tp or a sharded strategy instead).",
            ))  # fmt: skip
        if found:
            why, fix = found[0]
            raise ConfigError(
                f"on_policy (lmbda={self.on_policy.lmbda}, validate={self.on_policy.validate}) "
                f"samples from the student: {why}.",
                fix=f"{fix} Or set on_policy.lmbda=0 on_policy.validate=false (the data's "
                "completions only).",
            )
        check_pool(self.on_policy.engine, self.on_policy.max_completion_length, "on_policy.engine.")

    def cautions(self) -> list[str]:
        """A cross-entropy term on on-policy steps: it trains the student toward the tokens
        it sampled itself. Legal, so said and not refused."""
        found = super().cautions()
        if self.on_policy.lmbda > 0 and dict(self.loss).get("ce_weight", 0.5) > 0:
            found.append(
                f"loss.ce_weight={dict(self.loss).get('ce_weight', 0.5)} with "
                f"on_policy.lmbda={self.on_policy.lmbda}: on an on-policy step the "
                "cross-entropy's labels are the student's own samples, so it pulls the student "
                "toward what it already says (GKD and TRL use the divergence alone). Set "
                "loss.ce_weight=0 loss.kd_weight=1."
            )
        return found


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
        self.seq_len = data_seq_len = train_set.seq_len
        seq_key, on_policy = "dataset.seq_len", cfg.on_policy
        if on_policy.samples:  # a prompt, then a sampled completion
            self.seq_len += on_policy.max_completion_length
            seq_key += " + on_policy.max_completion_length"
        # the student and the teacher's shape on the meta device, each checked against the
        # data; their vocabularies must be one
        packed = packs(train_set)
        model = setup.meta_model(cfg.model, self.seq_len, packed, seq_key=seq_key)
        shape = setup.meta_model(
            cfg.teacher.model, self.seq_len, packed, teacher_tokenizer, seq_key=seq_key
        )
        check_same_vocabulary(
            setup.tokenizer, teacher_tokenizer, model.config.vocab_size, shape.config.vocab_size
        )
        if on_policy.samples:  # rows of prompts of many lengths, sampled
            check_generates(model, "on_policy")
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
        self.samples = None
        if on_policy.samples:  # the student's completions: to train on, or to validate on
            ends = ending_ids(setup.tokenizer.eos_id, [cfg.model_dir])
            rows = cfg.batch_size // self.groups.dp_size
            self.samples = StudentSamples(self.plan, on_policy, ends, cfg.seed, rows)

        names = source_names(train_set)
        collate = functools.partial(DistillBatch.collate_teacher, source_names=names)
        self.train_loader, self.val_loader = setup.loaders(train_set, val_set, collate)
        setup.start(
            self.train_loader,
            train_set,
            # a row's positions: a prompt and a sample with lmbda > 0, else the data's
            tokens_per_sample=self.seq_len if on_policy.lmbda > 0 else data_seq_len,
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
            more = {}  # with on_policy.lmbda > 0: whether the step is on-policy, its sampling time
            if cfg.on_policy.lmbda > 0:
                more["on_policy"] = float(self.samples.on_policy(run.step))
            if more.get("on_policy"):  # each row's completion the student's own sample
                started = time.perf_counter()
                batches = self.samples.of_training(batches, run.step)
                more["time/generation"] = time.perf_counter() - started
            self.optimizer.zero_grad(set_to_none=True)
            sums, num_tokens = accumulate_gradients(
                self.plan, batches, self.compute_loss, count=DistillBatch.loss_tokens
            )
            grad_norm = optimizer_step(
                self.plan, self.optimizer, self.decoder.lr_scheduler, cfg.max_grad_norm
            )
            run.advance(grad_norm, real_tokens(batches, self.groups), loss_tokens=num_tokens)
            if run.log_due():
                run.log_train(sums, num_tokens, grad_norm, more)
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
        cross-entropy of the labels, and its perplexity); with `on_policy`'s validation,
        the teacher's reverse KL on the student's samples of the same prompts
        (`val/student_samples/reverse_kl`); every rank takes part."""
        cfg = self.cfg
        self.model.eval()
        batches = itertools.islice(self.val_loader, cfg.eval.max_batches)  # None: all
        rows = cfg.batch_size // self.groups.dp_size
        metrics = validation_means(self.plan, batches, self.loss_fn, rows, perplexity_of="ce")
        if self.samples is not None and cfg.on_policy.validates:
            teacher, chunks = self.loss_fn.teacher, self.loss_fn.loss.num_chunks
            metrics.update(
                self.samples.validation(
                    self.val_loader, cfg.eval.max_batches, teacher, chunks, rows
                )
            )
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

"""Reward modeling: a decoder with a scalar head (`freetx.models.scorer`: transformers'
`XForSequenceClassification` layout, one label) trained on preference pairs with the
Bradley-Terry loss, so that a chosen completion scores above its rejected one; all of the
model's weights, or LoRA / QLoRA / DoRA adapters with the score head trained whole
(`peft:`; exported for PEFT as a SEQ_CLS adapter), on FSDP2 / ZeRO / DDP strategies. The reward a GRPO run can then read
(docs/recipes/rm_fsdp2.md).

    freetx run --nproc-per-node 2 full_finetune_fsdp2 --config llm/instruct_tiny  # the SFT
    freetx run --nproc-per-node 2 rm_fsdp2 --config llm/rm_tiny
    freetx checkpoint convert runs/llm_rm_tiny rm_hf --to hf   # AutoModelForSequenceClassification

The same pairs as DPO (`freetx.data.PreferenceDataset`): a micro-batch holds whole pairs,
row 2i the chosen sequence and row 2i + 1 the rejected one, in one forward; each row's
score is read at its last token that is not padding (transformers' rule), on the whole
sequence (the prompt, the completion and its end token). The loop is `train()`, top to
bottom: each micro-batch's loss summed over its pairs, normalized by the pairs of the
global batch. Copy this file (`freetx cp rm_fsdp2 ./my_rm.py`) to change the loop itself.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from freetx.config import instantiate
from freetx.data import (
    PreferenceBatch,
    PreferenceDataset,
    UnpairedPreferenceDataset,
    collate_pairs,
)
from freetx.entry import parse
from freetx.errors import ConfigError
from freetx.models.scorer import SequenceScorer, check_pad_id, pooled_scores
from freetx.objectives.cross_entropy import with_router_loss
from freetx.objectives.reward_model import BradleyTerryLoss, PairMetrics
from freetx.training import (
    PlannedRun,
    accumulate_gradients,
    dataset_seq_len,
    first_batches_padding,
    optimizer_step,
    real_tokens,
)
from freetx.training.decoder import DecoderConfig, DecoderSetup
from freetx.training.export import built_class
from freetx.training.step import placed


@dataclass
class RewardModelConfig(DecoderConfig):
    """The schema of this recipe's configs: DecoderConfig's keys, then these. batch_size
    counts pairs (each two sequences); the model is a sequence scorer
    (`freetx.models.scorer.scorer`, `hf_scorer`); the dataset a PreferenceDataset."""

    loss: Any = field(default_factory=lambda: {"_component_": "freetx.objectives.BradleyTerryLoss"})

    def refuse_combinations(self) -> None:
        """A model that is no sequence scorer; a dataset that gives no pairs (or KTO's
        examples), or packs them; the parallel axes a score at each row's last token does
        not take (tp, cp, pp); QAT (its head would be quantized) and lm-eval tasks (they
        read logits). And DecoderConfig's."""
        super().refuse_combinations()
        model = built_class(self.model)
        if model is not None and not issubclass(model, SequenceScorer):
            raise ConfigError(
                f"model._component_ builds {model.__name__}; rm_fsdp2 trains a sequence "
                "scorer: a decoder with a scalar head read at each sequence's last token.",
                fix="Use freetx.models.scorer.scorer (preset, fields) or "
                "freetx.models.scorer.hf_scorer (path: an HF folder), with the same weights.",
            )
        dataset = built_class(self.dataset, "dataset")
        if dataset is not None and (
            not issubclass(dataset, PreferenceDataset)
            or issubclass(dataset, UnpairedPreferenceDataset)  # its odd rows: KL rows
        ):
            raise ConfigError(
                f"dataset._component_ builds {dataset.__name__}; rm_fsdp2 trains on pairs of "
                "a chosen and a rejected completion.",
                fix="Use freetx.data.PreferenceDataset ({prompt, chosen, rejected} records).",
            )
        if self.dataset.get("packed", False):
            raise ConfigError(
                "dataset.packed=true: a reward model scores each sequence at its last token, "
                "one pair per two rows.",
                fix="Set dataset.packed=false.",
            )
        for axis in ("tp", "cp", "pp"):
            if getattr(self.distributed, axis) > 1:
                raise ConfigError(
                    f"distributed.{axis}={getattr(self.distributed, axis)}: rm_fsdp2 reads "
                    "each row's score at its last real token whole on one rank.",
                    fix=f"Use a sharded strategy (fsdp, hsdp) instead, with {axis}=1.",
                )
        for key, on in (("qat.scheme", self.qat.scheme != "none"),
                        ("eval.after_training", self.eval.after_training)):  # fmt: skip
            if on:
                raise ConfigError(
                    f"{key}: rm_fsdp2's model scores sequences; "
                    + (
                        "quantization-aware training would quantize its score head"
                        if key == "qat.scheme"
                        else "lm-eval's tasks read a language model's logits"
                    )
                    + ".",
                    fix=f"Leave {key} at its default ({'none' if key == 'qat.scheme' else 'false'}).",
                )

    def planned(self) -> PlannedRun:  # pairs: two sequences per sample, one token longer
        seq_len = dataset_seq_len(self)
        return PlannedRun(
            self.model,
            None if seq_len is None else seq_len + 1,
            self.peft,
            self.loss,
            rows_per_sample=2,
            tokenizer=self.tokenizer,
            dataset=self.dataset,
        )


class RewardModelRecipeFSDP2:
    def __init__(self, cfg: RewardModelConfig) -> None:
        self.cfg = cfg
        self.accumulation = cfg.gradient_accumulation_steps

    def setup(self) -> None:
        cfg = self.cfg
        self.decoder = setup = DecoderSetup(cfg, "rm_fsdp2")  # the run, ranks, tokenizer
        self.run, self.groups = setup.run, setup.groups
        self.loss_fn: BradleyTerryLoss = instantiate(cfg.loss)
        with torch.device("meta"):  # the pad id it reads scores by: the tokenizer's
            self.pad_id = check_pad_id(instantiate(cfg.model), setup.tokenizer)
        train_set, val_set = setup.datasets()  # pairs cut at seq_len: said
        self.seq_len = train_set.seq_len
        # the whole sequence: the prompt, the completion and its end token (one more)
        model = setup.meta_model(cfg.model, self.seq_len + 1)
        self.plan = setup.build(model)  # parallelize, optimizer, schedule
        self.model, self.optimizer = self.plan.model, setup.optimizer
        self.train_loader, self.val_loader = setup.loaders(train_set, val_set, collate_pairs)
        setup.start(
            self.train_loader,
            train_set,
            tokens_per_sample=2 * (self.seq_len + 1),
            flops_seq_len=self.seq_len + 1,
            seq_len=self.seq_len + 1,
            train_pairs=train_set.summary().samples,
            padding=first_batches_padding(self.train_loader),
        )

    def train(self) -> None:
        cfg, run = self.cfg, self.run
        data = iter(self.train_loader)
        self.model.train()
        while run.step < cfg.max_steps and not run.stopping:  # stopping: SIGTERM, ^C
            batches = [next(data) for _ in range(self.accumulation)]
            self.optimizer.zero_grad(set_to_none=True)
            sums, num_pairs = accumulate_gradients(
                self.plan, batches, self.compute_loss, count=PreferenceBatch.num_pairs
            )
            grad_norm = optimizer_step(
                self.plan, self.optimizer, self.decoder.lr_scheduler, cfg.max_grad_norm
            )
            run.advance(grad_norm, real_tokens(batches, self.groups))
            if run.log_due():
                run.log_train(sums, num_pairs, grad_norm)
            if run.due(cfg.eval.every_n_steps):
                run.evaluate(self.evaluate)
            if run.due(cfg.checkpoint.every_n_steps):
                run.save()
        self.decoder.finish(self.evaluate)  # the last step's; its export; lm-eval tasks

    def scores(self, batch: PreferenceBatch):
        """Each row's score [2P] (and the forward's output: an MoE model's router loss)."""
        sequences = batch.sequences(self.pad_id)
        output = self.model(sequences)
        return pooled_scores(output, sequences, self.pad_id), output

    def compute_loss(self, batch: PreferenceBatch):
        """One micro-batch of pairs: each row's score and the loss summed over the pairs,
        each pair's margin from its row (+ the metrics' sums)."""
        scores, output = self.scores(batch)
        loss, metrics = self.loss_fn(scores, batch.pair_margins())
        return with_router_loss(output, loss, metrics, batch.num_pairs())

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The loss, accuracy, margin and the rewards' mean, std, min and max over the validation
        pairs (all of them, or eval.max_batches), every rank taking part; an evaluation
        shard's repeats left out."""
        self.model.eval()
        metrics = PairMetrics(self.loss_fn)
        for batch in itertools.islice(self.val_loader, self.cfg.eval.max_batches):
            batch = placed(self.plan, batch)
            with self.plan.autocast():
                scores, _ = self.scores(batch)
            metrics.add(scores, batch)
        means = metrics.means(self.groups, over="dp")
        self.model.train()
        return {f"val/{name}": value for name, value in means.items()}

    def cleanup(self) -> None:
        self.run.close()


@parse(RewardModelConfig)
def recipe_main(cfg: RewardModelConfig) -> None:
    recipe = RewardModelRecipeFSDP2(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())

"""Preference optimization: DPO and its kin (IPO, robust DPO, hinge, SimPO, ORPO) on pairs
of a chosen and a rejected completion to one prompt, and KTO on unpaired completions
labelled desirable or not; all of the model's weights, or LoRA / QLoRA / DoRA adapters
(`peft:`), on FSDP2 / ZeRO / DDP strategies with tp and cp.

    freetx run --nproc-per-node 2 full_finetune_fsdp2 --config llm/instruct_tiny  # the SFT
    freetx run --nproc-per-node 2 dpo_fsdp2 --config llm/dpo_tiny
    freetx run --nproc-per-node 2 dpo_fsdp2 --config llm/hf_tiny_dpo model_dir=DIR dataset.source=pairs.jsonl
    freetx run --nproc-per-node 2 dpo_fsdp2 --config llm/kto_tiny

A micro-batch holds whole pairs, row 2i the chosen completion and row 2i+1 the rejected
one (`freetx.data.PreferenceDataset`), in one forward. The loss (`loss.type`) compares
each row's summed log-probabilities under the policy with the reference's (DPO's π_ref),
the model the policy starts from (`freetx.objectives.reference`): with adapters, the
policy with them disabled; in full fine-tuning a frozen copy, or (`reference.precompute`)
its log-probs computed once before training (kept in output_dir/reference_logps), the copy
then freed; none for SimPO and ORPO. The loop is `train()`, top to bottom: each
micro-batch's loss summed over its pairs, normalized by the pairs of the global batch.
KTO (`loss: freetx.objectives.KTOLoss`, `freetx.data.UnpairedPreferenceDataset`): each
example's row is paired with a KL row (its prompt, another example's completion); each
step first measures the KL baseline on the global batch's KL rows, without a gradient
(`kl_baseline`), then the loss on the examples' rows.
Copy this file (`freetx cp dpo_fsdp2 ./my_dpo.py`) to change the loop itself.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from freetx.checkpoint import input_identity
from freetx.config import instantiate
from freetx.data import (
    PreferenceBatch,
    PreferenceDataset,
    UnpairedPreferenceDataset,
    collate_pairs,
)
from freetx.data.packing import packs
from freetx.entry import parse
from freetx.errors import ConfigError
from freetx.objectives import KTOBaseline, KTOLoss, PreferenceLoss
from freetx.objectives.cross_entropy import with_router_loss
from freetx.objectives.kto import kl_sums
from freetx.objectives.logprobs import SequenceLogProbs
from freetx.objectives.reference import (
    Precomputed,
    ReferenceConfig,
    batch_logps,
    kept_pairs,
    reference_kind,
    reference_model,
    with_reference_logps,
)
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
class DPOConfig(DecoderConfig):
    """The schema of this recipe's configs: DecoderConfig's keys, then these. batch_size
    counts pairs (each two sequences); the dataset is a PreferenceDataset."""

    fixed_on_resume: ClassVar[tuple[str, ...]] = (
        *DecoderConfig.fixed_on_resume,
        "loss",
        "reference",
    )

    loss: Any = field(default_factory=lambda: {"_component_": "freetx.objectives.PreferenceLoss"})
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)

    def refuse_combinations(self) -> None:
        """A dataset that gives no pairs; a reference that cannot be precomputed
        (`ReferenceConfig`); pipeline parallelism. And DecoderConfig's (QAT with tp, an evaluation without validation rows)."""
        super().refuse_combinations()
        loss_type = self.loss.get("type", "sigmoid")
        dataset = built_class(self.dataset, "dataset")
        if dataset is not None and not issubclass(dataset, PreferenceDataset):
            raise ConfigError(
                f"dataset._component_ builds {dataset.__name__}, whose samples are single "
                "sequences; dpo_fsdp2 trains on pairs of a chosen and a rejected completion.",
                fix="Use freetx.data.PreferenceDataset ({prompt, chosen, rejected} records, or "
                "conversations), or train on this data with full_finetune_fsdp2.",
            )
        loss = built_class(self.loss, "loss")
        kto = loss is not None and issubclass(loss, KTOLoss)
        if dataset is not None and issubclass(dataset, UnpairedPreferenceDataset) != kto:
            raise ConfigError(
                f"loss._component_ builds {getattr(loss, '__name__', loss)} and "
                f"dataset._component_ {dataset.__name__}: "
                + (
                    "KTO learns from unpaired examples, each with its label."
                    if kto
                    else "DPO and its kin compare a chosen with a rejected completion."
                ),
                fix="Use freetx.data.UnpairedPreferenceDataset ({prompt, completion, label} rows)"
                " with freetx.objectives.KTOLoss, or freetx.data.PreferenceDataset ({prompt, "
                "chosen, rejected}) with freetx.objectives.PreferenceLoss.",
            )
        packed = bool(self.dataset.get("packed", False))
        self.reference.refuse_combinations(self.peft.method, loss_type, packed)
        if self.distributed.pp > 1:
            raise ConfigError(
                f"distributed.pp={self.distributed.pp}: dpo_fsdp2 runs no pipeline (the "
                "reference's forward would need a schedule of its own through the stages, "
                "and the loss both rows of a pair at the last one).",
                fix="Use distributed.tp, cp or a sharded strategy instead, with pp=1.",
            )

    def planned(self) -> PlannedRun:  # pairs: two sequences per sample, with the reference
        return PlannedRun(
            self.model,
            dataset_seq_len(self),
            self.peft,
            self.loss,
            rows_per_sample=2,
            reference=self.reference_kind(),
            tokenizer=self.tokenizer,
            dataset=self.dataset,
        )

    def reference_kind(self) -> str:
        """none (simpo, orpo), adapters_off (LoRA), precomputed, or frozen_copy."""
        loss = instantiate(self.loss)
        return reference_kind([loss], self.peft.method != "none", self.reference.precompute)


class DPORecipeFSDP2:
    def __init__(self, cfg: DPOConfig) -> None:
        self.cfg = cfg
        self.accumulation = cfg.gradient_accumulation_steps

    def setup(self) -> None:
        cfg = self.cfg
        self.decoder = setup = DecoderSetup(cfg, "dpo_fsdp2")  # the run, ranks, tokenizer
        self.run, self.groups = setup.run, setup.groups
        self.loss_fn: PreferenceLoss | KTOLoss = instantiate(cfg.loss)
        self.unpaired = isinstance(self.loss_fn, KTOLoss)  # KTO: examples and their KL rows
        train_set, val_set = setup.datasets()  # pairs cut or dropped at seq_len: said
        self.seq_len = train_set.seq_len
        model = setup.meta_model(cfg.model, self.seq_len, packed=packs(train_set))
        self.plan = setup.build(model)  # PEFT, QAT, parallelize, optimizer, schedule
        self.model, self.optimizer = self.plan.model, setup.optimizer

        # the reference: the base with adapters off, a frozen copy, or its log-probs
        # precomputed into the data (then the copy is freed); none for simpo and orpo
        kind = reference_kind([self.loss_fn], cfg.peft.method != "none", cfg.reference.precompute)
        train_pairs, val_pairs = self.build_reference(kind, train_set, val_set)  # what is read
        self.train_loader, self.val_loader = setup.loaders(train_pairs, val_pairs, collate_pairs)
        setup.start(
            self.train_loader,
            train_set,
            tokens_per_sample=2 * self.seq_len,
            flops_seq_len=self.seq_len,
            seq_len=self.seq_len,
            models={"reference": None if kind == "none" else cfg.checkpoint.initial_weights},
            # packed: its packs hold more; KTO's: examples, each with its KL row
            **{f"train_{train_set.UNIT}": train_set.summary().samples},
            padding=first_batches_padding(self.train_loader),
            reference=kind.replace("_", " "),
        )

    def build_reference(self, kind: str, train_set, val_set):
        """The reference (`reference_kind`): where the policy starts, its weights loaded
        as the policy's initial weights are (or the same random init). Precomputed: a
        frozen copy computes every pair's log-probs once (or they are read back from
        output_dir/reference_logps), the pairs carry them, and the copy is freed.
        Returns the datasets the loaders read."""
        cfg, weights = self.cfg, self.cfg.checkpoint.initial_weights
        self.reference = reference_model(
            kind, self.plan, cfg.model, cfg.seed, weights, self.loss_fn.num_chunks
        )
        if kind != "precomputed":
            return train_set, val_set
        weights_id = input_identity(weights)["fingerprint"] if weights else f"seed {cfg.seed}"
        identity, batch = {"reference": weights_id}, cfg.eval.batch_size
        splits = ((train_set, "train"), (val_set, "validation"))
        datasets = [
            with_reference_logps(
                self.reference,
                data,
                split,
                identity,
                cfg.output_dir,
                self.plan,
                batch,
                self.run.write,
            )
            if data is not None  # None: no validation split
            else None
            for data, split in splits
        ]
        self.reference = Precomputed()  # the copy is freed
        return datasets

    def train(self) -> None:
        cfg, run = self.cfg, self.run
        data = iter(self.train_loader)
        self.model.train()
        while run.step < cfg.max_steps and not run.stopping:  # stopping: SIGTERM, ^C
            batches = [next(data) for _ in range(self.accumulation)]
            if self.unpaired:  # KTO: the KL baseline over the whole global batch first
                self.baseline = self.kl_baseline(batches)
            self.optimizer.zero_grad(set_to_none=True)
            sums, num_pairs = accumulate_gradients(
                self.plan, batches, self.compute_loss, count=PreferenceBatch.num_pairs
            )
            grad_norm = optimizer_step(
                self.plan, self.optimizer, self.decoder.lr_scheduler, cfg.max_grad_norm
            )
            run.advance(grad_norm, real_tokens(batches, self.groups))
            if run.log_due():
                run.log_train(sums, num_pairs, grad_norm, self.kl_metric())
            if run.due(cfg.eval.every_n_steps):
                run.evaluate(self.evaluate)
            if run.due(cfg.checkpoint.every_n_steps):
                run.save()
        self.decoder.finish(self.evaluate)  # the last step's; QAT's export; lm-eval tasks

    def compute_loss(self, batch: PreferenceBatch):
        """One micro-batch of pairs: the policy's log-probs (with a gradient), the
        reference's, and the loss summed over the pairs (+ the metrics' sums). KTO: of its
        examples' rows alone, with the step's KL baseline."""
        if self.unpaired:
            examples = batch.chosen_rows()
            policy, output = batch_logps(self.model, examples, self.loss_fn.num_chunks, self.groups)
            loss, metrics = self.loss_fn(
                policy, self.reference(examples), examples.desirable, self.baseline
            )
        else:
            policy, output = batch_logps(self.model, batch, self.loss_fn.num_chunks, self.groups)
            reference = self.reference(batch) if self.reference is not None else None
            loss, metrics = self.loss_fn(policy, reference)
        return with_router_loss(output, loss, metrics, batch.num_pairs())  # MoE: router loss

    @torch.no_grad()
    def kl_baseline(self, batches: list[PreferenceBatch]) -> KTOBaseline:
        """KTO's KL baseline for one optimizer step: the policy's and the reference's
        log-probs of every micro-batch's KL rows (no gradient), over every rank."""
        sums = {}
        for batch in batches:
            rows = placed(self.plan, batch).rejected_rows()
            with self.plan.autocast():
                policy, _ = batch_logps(self.model, rows, self.loss_fn.num_chunks, self.groups)
                reference = self.reference(rows)
            for name, value in kl_sums(policy, reference, rows.desirable).items():
                sums[name] = sums.get(name, 0) + value
        return KTOBaseline.of(self.groups.sum(sums, over="dp"))

    def kl_metric(self) -> dict[str, float]:
        """KTO's logged KL baseline (TRL's `kl`); nothing for DPO and its kin."""
        return {"kl": self.baseline.kl} if self.unpaired else {}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The loss and the rewards' metrics over the validation pairs (all of them, or
        eval.max_batches), every rank taking part; an evaluation shard's repeats left out."""
        self.model.eval()
        sums, kept = {}, []
        for batch in itertools.islice(self.val_loader, self.cfg.eval.max_batches):
            batch = placed(self.plan, batch)
            with self.plan.autocast():
                policy, _ = batch_logps(self.model, batch, self.loss_fn.num_chunks, self.groups)
                reference = self.reference(batch) if self.reference is not None else None
            keep = batch.real_pairs()
            policy, reference = kept_pairs(policy, keep), kept_pairs(reference, keep)
            if self.unpaired:  # the loss once the whole split's KL baseline is known
                desirable = batch.chosen_rows().desirable[keep]
                kept.append((policy.chosen(), reference.chosen(), desirable))
                parts = kl_sums(policy.rejected(), reference.rejected(), desirable)
            else:
                loss, parts = self.loss_fn(policy, reference)
                parts["loss"] = loss
            for name, value in {**parts, "pairs": batch.num_pairs()}.items():
                sums[name] = sums.get(name, 0) + value
        totals = self.groups.sum(sums, over="dp_cp")
        if self.unpaired:
            totals |= self.unpaired_losses(kept, totals)
        self.model.train()
        pairs = max(totals.pop("pairs"), 1.0)
        return {f"val/{name}": value / pairs for name, value in totals.items()}

    def unpaired_losses(self, kept: list, totals: dict) -> dict[str, float]:
        """KTO's validation: the loss and metrics' sums of the examples `kept` (each batch's
        policy and reference log-probs and labels), with the KL baseline of the whole
        split (`totals`' KL sums, popped), summed over every rank; and `kl` as a sum."""
        baseline = KTOBaseline.of({k: totals.pop(k) for k in ("kl", "examples", "desirable")})
        policy, reference = (
            SequenceLogProbs(
                *(torch.cat([getattr(k[i], f) for k in kept]) for f in ("sum", "tokens"))
            )
            for i in (0, 1)
        )
        loss, parts = self.loss_fn(policy, reference, torch.cat([k[2] for k in kept]), baseline)
        sums = self.groups.sum({"loss": loss, **parts}, over="dp_cp")
        return {**sums, "kl": baseline.kl * baseline.examples}

    def cleanup(self) -> None:
        self.run.close()


@parse(DPOConfig)
def recipe_main(cfg: DPOConfig) -> None:
    recipe = DPORecipeFSDP2(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())

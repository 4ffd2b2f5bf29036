"""The reference of a preference loss: the log-probabilities the policy's are measured
against (DPO's π_ref), made whole over context-parallel ranks, without a gradient.

    reference = AdaptersOff(plan, num_chunks)        # LoRA / QLoRA / DoRA: the base itself
    reference = FrozenCopy(model, plan, num_chunks)  # full fine-tuning: a frozen copy
    reference = Precomputed()                        # reference.precompute: read from the batch
    logps = reference(batch)                         # SequenceLogProbs, one per row

- `AdaptersOff`: the policy's own forward with every adapter disabled
  (`freetx.models.peft.adapters_disabled`): the base model, with no second copy of the
  weights.
- `FrozenCopy`: a copy of the model sharded like the policy
  (`freetx.distributed.parallelize_frozen`: FSDP2 per block, the compute dtype, no
  gradients, no optimizer state), its weights read from the policy's initial weights.
- `Precomputed`: each row's reference log-probs were computed in one pass over the
  data before training (`with_reference_logps`), stored in the run folder under the
  identity of the data and of the reference weights, and ride in the batch
  (`PreferenceBatch.reference_logps`); the reference model is freed before training.

SimPO and ORPO need none (`PreferenceLoss.needs_reference`).
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.data import Dataset

from freetx.checkpoint import load_initial_weights
from freetx.config import instantiate
from freetx.data import PreferenceBatch, TokenBatch, collate_pairs
from freetx.data.batch import REFERENCE_LOGPS, Pair
from freetx.distributed import ParallelGroups, ParallelPlan, parallelize_frozen
from freetx.errors import ConfigError
from freetx.models.peft import adapters_disabled
from freetx.objectives.logprobs import SequenceLogProbs, sequence_logps, token_logps
from freetx.objectives.precompute import per_sample_table, samples_digest, stored_or_computed
from freetx.objectives.preference import PreferenceLoss

REFERENCE_FOLDER = "reference_logps"  # in output_dir: one file per split


def batch_logps(
    model: nn.Module, batch: PreferenceBatch, num_chunks: int | None, groups: ParallelGroups
) -> tuple[SequenceLogProbs, Any]:
    """Each row's summed log-probs over its loss tokens (and the forward's output), whole
    over the context-parallel ranks (each holds a part of every row: summed over `cp`,
    the gradient too): the policy's with a gradient, a reference's under no_grad."""
    logps, output = sequence_logps(
        model, batch.input_ids, batch.labels, num_chunks, **batch.model_inputs()
    )
    if groups.size("cp") > 1:
        whole = groups.sum_with_gradient(torch.stack([logps.sum, logps.tokens]), over="cp")
        logps = SequenceLogProbs(whole[0], whole[1])
    return logps, output


def kept_pairs(logps: SequenceLogProbs | None, keep: torch.Tensor):
    """The rows of the pairs `keep` marks (an evaluation shard's repeats left out)."""
    if logps is None:
        return logps
    rows = keep.to(logps.sum.device).repeat_interleave(2)
    return SequenceLogProbs(logps.sum[rows], logps.tokens[rows])


class Reference(Protocol):
    """Each row's reference log-probs for a (placed) preference batch, no gradient."""

    def __call__(self, batch: PreferenceBatch) -> SequenceLogProbs: ...


class _ReferenceModel(abc.ABC):
    """A reference that is a model to run: each preference row's summed log-probs
    (`__call__`), or each label's of any token batch (`tokens`, GRPO's KL term); `run`
    calls a forward with the model, under no_grad, as the kind of reference needs."""

    num_chunks: int | None
    plan: ParallelPlan

    def __call__(self, batch: PreferenceBatch) -> SequenceLogProbs:
        return self.run(
            lambda model: batch_logps(model, batch, self.num_chunks, self.plan.groups)[0]
        )

    def tokens(self, batch: TokenBatch) -> torch.Tensor:
        """[B, T] each label's log-probability (0 where it is ignored)."""
        inputs = batch.model_inputs()
        return self.run(
            lambda model: token_logps(
                model, batch.input_ids, batch.labels, self.num_chunks, **inputs
            )[0]
        )

    @abc.abstractmethod
    def run(self, forward): ...


class AdaptersOff(_ReferenceModel):
    """The policy with its adapters disabled: LoRA's, QLoRA's and DoRA's reference."""

    def __init__(self, plan: ParallelPlan, num_chunks: int | None) -> None:
        self.plan, self.num_chunks = plan, num_chunks

    @torch.no_grad()
    def run(self, forward):
        with adapters_disabled(self.plan.module):
            return forward(self.plan.model)


class FrozenCopy(_ReferenceModel):
    """A frozen copy of the model, parallelized like the policy (`parallelize_frozen`),
    its weights read from the policy's initial weights (`build`)."""

    def __init__(self, model: nn.Module, plan: ParallelPlan, num_chunks: int | None) -> None:
        self.model, self.plan, self.num_chunks = model, plan, num_chunks

    @classmethod
    def build(
        cls, model_node, plan: ParallelPlan, seed: int, weights: str | None, num_chunks: int | None
    ) -> FrozenCopy:
        """The copy of the model `model_node` builds, parallelized like `plan`'s policy,
        from `weights` (the policy's initial weights) or, without any, the seed's random
        init, as the policy's."""
        with torch.device("meta"):
            copy = instantiate(model_node)
        copy = parallelize_frozen(copy, plan.groups, plan.cfg, seed, init_weights=weights is None)
        if weights is not None:
            load_initial_weights(copy, weights)
        return cls(copy, plan, num_chunks)

    @torch.no_grad()
    def run(self, forward):
        with self.plan.autocast():
            return forward(self.model)


class Precomputed:
    """The reference log-probs a batch carries (`reference.precompute: true`)."""

    def __call__(self, batch: PreferenceBatch) -> SequenceLogProbs:
        if batch.reference_logps is None:
            raise ValueError("Precomputed: the batch carries no reference_logps")
        logps = batch.reference_logps.to(batch.input_ids.device)
        return SequenceLogProbs(logps[:, 0], logps[:, 1])


@dataclass
class ReferenceConfig:
    """A preference recipe's `reference:` section (none for simpo and orpo): the policy's
    initial weights, as the base with adapters off, a frozen copy, or precomputed."""

    # full fine-tuning: the reference's log-probs in one pass before training, then the
    # frozen copy is freed (LoRA's reference, the base with adapters off, costs no copy)
    precompute: bool = False

    def refuse_combinations(self, peft_method: str, loss_type: str, packed: bool) -> None:
        """A reference to precompute that costs nothing (the base with adapters off), does
        not exist (`loss_type` reference-free: simpo, orpo) or cannot follow packs."""
        if self.precompute and peft_method != "none":
            raise ConfigError(
                f"reference.precompute=true: with adapters (peft.method={peft_method}) the "
                "reference is the base with its adapters disabled, which costs no copy of the "
                "weights.",
                fix="Set reference.precompute=false.",
            )
        if self.precompute and not PreferenceLoss.type_needs_reference(loss_type):
            raise ConfigError(
                f"reference.precompute=true: loss.type={loss_type} is reference-free.",
                fix="Set reference.precompute=false.",
            )
        if self.precompute and packed:
            raise ConfigError(
                "reference.precompute=true with dataset.packed=true: the precomputed "
                "log-probs are kept per pair, and packs place pairs by the seed.",
                fix="Set one of them to false (a frozen copy serves packed pairs).",
            )


@runtime_checkable
class ComparesWithReference(Protocol):
    """A loss or an estimate that may compare the policy with a reference model
    (`PreferenceLoss` by its type, `GRPOLoss` by its KL term's beta, `ReinforcePlusPlus`
    by the KL it folds into the reward)."""

    @property
    def needs_reference(self) -> bool: ...


def reference_kind(objectives: Sequence[Any], adapters: bool, precompute: bool = False) -> str:
    """What built objectives (a loss; an advantage estimate) compare with: none when none of
    them does (SimPO, ORPO; GRPO at beta 0), adapters_off (a run that trains adapters: the
    base itself), precomputed (`reference.precompute`: log-probs computed once before
    training), or frozen_copy (full fine-tuning)."""
    if not any(isinstance(o, ComparesWithReference) and o.needs_reference for o in objectives):
        return "none"
    if adapters:
        return "adapters_off"
    return "precomputed" if precompute else "frozen_copy"


def reference_model(
    kind: str,
    plan: ParallelPlan,
    model_node,
    seed: int,
    weights: str | None,
    num_chunks: int | None,
) -> AdaptersOff | FrozenCopy | None:
    """The model a `reference_kind` runs: the policy with adapters off, a frozen copy from the
    policy's initial `weights` (precomputed: the copy that computes them), or none."""
    if kind == "adapters_off":
        return AdaptersOff(plan, num_chunks)
    if kind in ("frozen_copy", "precomputed"):
        return FrozenCopy.build(model_node, plan, seed, weights, num_chunks)
    return None


class WithReferenceLogps(Dataset):
    """A preference dataset whose pairs carry their precomputed reference log-probs:
    `table` [pairs, 2 rows, (sum, tokens)], in the dataset's order."""

    def __init__(self, dataset: Dataset, table: torch.Tensor) -> None:
        self.dataset, self.table = dataset, table

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Pair:
        (chosen, rejected), logps = self.dataset[index], self.table[index]
        return {**chosen, REFERENCE_LOGPS: logps[0]}, {**rejected, REFERENCE_LOGPS: logps[1]}


def with_reference_logps(
    reference: Reference,
    dataset: Dataset,
    split: str,
    identity: dict[str, Any],
    output_dir: str | Path,
    plan: ParallelPlan,
    pairs_per_pass: int,
    say: Callable[[str], None],
) -> WithReferenceLogps:
    """`dataset` with the reference log-probs of every pair, computed once: read from
    output_dir/reference_logps/<split>.safetensors when it was made for the same data (a
    digest of every pair's tokens) and `identity` (the reference weights'), else computed
    over all data-parallel ranks (each its strided share, `pairs_per_pass` pairs per
    forward over all ranks), gathered, and written there by rank 0. `say`: a line for
    the console."""
    path = Path(output_dir) / REFERENCE_FOLDER / f"{split}.safetensors"
    key = json.dumps({"split": split, "data": samples_digest(dataset), **identity}, sort_keys=True)

    def pair_logps(batch: PreferenceBatch) -> dict[str, torch.Tensor]:
        logps = reference(batch)  # a row per sequence: [pairs, 2 rows, (sum, tokens)]
        return {"logps": torch.stack([logps.sum, logps.tokens], dim=-1).double().view(-1, 2, 2)}

    table = stored_or_computed(
        path,
        key,
        lambda: per_sample_table(dataset, pair_logps, collate_pairs, plan, pairs_per_pass),
        plan,
        say,
        f"reference: {split} log-probs of {len(dataset)} pairs",
    )
    return WithReferenceLogps(dataset, table["logps"].float())

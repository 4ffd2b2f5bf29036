"""On-policy distillation (GKD, Agarwal et al. 2024; TRL's `GKDTrainer`): on a share
`lmbda` of the optimizer steps, the student trains on its own completions of the batch's
prompts instead of the data's, and the teacher scores every token the student sampled, so
the student learns where its own mistakes take it. kd_fsdp2 calls it, keeping its loss:

    samples = StudentSamples(plan, cfg.on_policy, end_ids, seed, rows_per_rank)
    if samples.on_policy(step):                         # TRL's coin, keyed by (seed, step)
        batches = samples.of_training(batches, step)    # each row: its prompt + a sample
    metrics = samples.validation(val_loader, max_batches, teacher, num_chunks, rows)

A row's prompt is its tokens up to its first label (`TokenBatch.prompts`: the user's turn
of a chat row, a prompt-completion row's prompt); the student's completion is sampled by
the generation engine, its parameters gathered once for the batch, each row's draws keyed
by the run's seed, the step and the row's place in the global batch (a validation row's:
its index in the split), so the samples are the same at any world size and after a resume.
The loss is the recipe's `DistillationLoss` on those rows: reverse KL (`divergence:
reverse_kl`, the per-token `log q(y) - log p(y)` taken over the whole vocabulary) or GKD's
JSD(beta), the teacher's and the student's logits a chunk of tokens at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from freetx.data import DistillBatch
from freetx.distributed import ParallelPlan
from freetx.fields import at_least
from freetx.models.engine import EngineConfig
from freetx.models.generation import Draws, Sampling, generate, sampling_problems
from freetx.objectives.distillation import Distill, DistillationLoss
from freetx.training import validation_means

# the teacher's own measure of a student: the mean per-token reverse KL on its samples
SAMPLES_METRIC = "val/student_samples/reverse_kl"


@dataclass
class OnPolicyConfig:
    """kd_fsdp2's `on_policy:`: how often and how the student samples its own completions."""

    # the share of optimizer steps trained on the student's samples (TRL GKD's lmbda): 0 is
    # off-policy KD on the data's completions, 1 every step on-policy
    lmbda: float = 0.0
    # val/student_samples/reverse_kl (the teacher's reverse KL on the student's samples of
    # the validation prompts) at each evaluation; None: when lmbda > 0
    validate: Optional[bool] = None
    max_completion_length: int = at_least(1, default=64)  # tokens, the end token included
    temperature: float = at_least(0, default=1.0)
    top_k: Optional[int] = at_least(1, default=None)
    top_p: Optional[float] = None  # (0, 1]; None: every token
    engine: EngineConfig = field(default_factory=EngineConfig)  # docs/generation.md

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """An lmbda outside [0, 1]; a top_p outside (0, 1]."""
        found = sampling_problems(values)
        lmbda = values.get("lmbda", 0.0)
        if not (isinstance(lmbda, (int, float)) and 0 <= lmbda <= 1):
            found["lmbda"] = (
                "it is the share of steps the student trains on its own samples; set a value "
                "in [0, 1] (0: the data's completions, 1: every step on-policy)."
            )
        return found

    def per_rank_forwards(self) -> str | None:
        """Each rank samples its own rows until they end, which expert parallelism cannot
        run (`freetx.training.config.ForwardsPerRank`)."""
        return "on_policy's samples of the student" if self.samples else None

    @property
    def samples(self) -> bool:
        """Whether the run samples from the student at all (to train or to validate)."""
        return self.lmbda > 0 or bool(self.validate)

    @property
    def validates(self) -> bool:
        """Whether each evaluation measures the reverse KL on the student's samples."""
        return self.lmbda > 0 if self.validate is None else bool(self.validate)


def keyed_uniform(key: str) -> float:
    """A number in [0, 1) that only `key` decides (the same on every rank and machine)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64


class StudentSamples:
    """The student's completions of a batch's prompts, as rows the distillation loss reads
    (module docstring). `rows_per_rank`: this rank's rows of a global batch; a row's place
    in the global batch is its rank's offset plus its place on the rank."""

    def __init__(
        self,
        plan: ParallelPlan,
        config: OnPolicyConfig,
        end_ids: list[int],
        seed: int,
        rows_per_rank: int,
    ) -> None:
        self.plan, self.config, self.end_ids, self.seed = plan, config, end_ids, seed
        self.sampling = Sampling(config.temperature, config.top_k, config.top_p)
        self.first_row = plan.groups.dp_rank * rows_per_rank

    def on_policy(self, step: int) -> bool:
        """Whether optimizer step `step` trains on the student's samples: TRL's coin with
        probability lmbda, drawn from the run's seed and the step."""
        return keyed_uniform(f"seed {self.seed} step {step} on-policy") < self.config.lmbda

    def of_training(self, batches: list[DistillBatch], step: int) -> list[DistillBatch]:
        """One optimizer step's micro-batches, each row's completion the student's."""
        keys, row = [], self.first_row
        for batch in batches:
            count = batch.input_ids.shape[0]
            keys.append([f"seed {self.seed} step {step} row {row + i}" for i in range(count)])
            row += count
        return self.sampled(batches, keys)

    @torch.no_grad()
    def sampled(self, batches: list[DistillBatch], keys: list[list[str]]) -> list[DistillBatch]:
        """`batches` with each row's completion sampled by the student, row i of batch b
        drawing from `keys[b][i]`; its parameters gathered once for all of them (every rank
        enters together), its train / eval mode as it was."""
        length = self.config.max_completion_length
        made = []
        with self.plan.gathered() as model, self.plan.autocast():
            training = model.training
            model.eval()
            for batch, row_keys in zip(batches, keys):
                prompts = batch.prompts()
                out = generate(
                    model,
                    prompts,
                    length,
                    self.sampling,
                    self.end_ids,
                    Draws.keyed(row_keys, length),
                    engine=self.config.engine,
                )
                rows = type(batch).of_completions(prompts, out.replies())
                made.append(dataclasses.replace(rows, sources=batch.sources, padding=batch.padding))
            model.train(training)
        return made

    def validation(
        self, val_loader, max_batches: int | None, teacher, num_chunks: int | None, rows: int
    ) -> dict[str, float]:
        """The teacher's reverse KL per token on the student's samples of the validation
        prompts (`SAMPLES_METRIC`), over every rank; each row's draws keyed by the seed and
        its index in the split. `rows`: the training's rows per step on a rank."""
        shard, measure = val_loader.dataset, Distill(reverse_kl(num_chunks), teacher)
        batches = itertools.islice(val_loader, max_batches)  # None: all

        def sampled():
            start = 0
            for batch in batches:
                count = batch.input_ids.shape[0]
                keys = [
                    f"seed {self.seed} validation row {shard.source(start + i)}"
                    for i in range(count)
                ]
                start += count
                yield self.sampled([batch], [keys])[0]

        found = validation_means(self.plan, sampled(), measure, rows, perplexity_of="kd")
        return {SAMPLES_METRIC: found["val/kd"]}


def reverse_kl(num_chunks: int | None) -> DistillationLoss:
    """The reverse KL(student || teacher) at temperature 1 alone: the validation measure."""
    return DistillationLoss(ce_weight=0.0, kd_weight=1.0, divergence="reverse_kl",
                            num_chunks=num_chunks)  # fmt: skip

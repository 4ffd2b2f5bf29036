"""The token batch: what a language model's datasets give, its loaders yield, and its
losses read, as one type. The keys of a token sample are spelled here and nowhere else.

    sample = token_sample(input_ids, labels, real_tokens=n)    # a dataset's item
    batch = TokenBatch.collate([sample, ...], source_names)    # a loader's micro-batch
    batch = collate_pairs([(chosen, rejected), ...])            # pairs: chosen, rejected, ...
    batch = batch.to(device).split(context)                    # this rank's part (cp)
    joined = TokenBatch.join(micro_batches)                    # a pipeline's step (pp)
    loss, sums = loss_fn(model, batch.input_ids, batch.labels, **batch.model_inputs())

A batch keeps its rows whole and in order through `join` (the micro-batches one after
another) and `split` (each row's part of the sequence), so rows that belong together (a
prompt's chosen and rejected answers, one after the other) stay on one rank and in one
micro-batch. A batch with more inputs (a teacher's) is a subclass with more fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

IGNORE_INDEX = -100  # a label that is no target (torch's cross-entropy default)
# the keys of a token sample (a dict: what `torch.utils.data` datasets give)
INPUT_IDS, LABELS, DOCUMENTS = "input_ids", "labels", "documents"
REAL_TOKENS = "real_tokens"  # the positions that are not padding (packed, padded samples)
SOURCE = "source"  # a mixture's: which of its sources the sample is from
PADDING = "padding"  # an evaluation shard's: a repeat that fills the last rank's share
DESIRABLE = "desirable"  # an unpaired preference example's label (KTO): its completion is good
MARGIN = "margin"  # a preference pair's margin (reward modeling: r_chosen - r_rejected's due)


def token_sample(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    documents: torch.Tensor | None = None,
    real_tokens: torch.Tensor | int | None = None,
) -> dict[str, torch.Tensor]:
    """A dataset's item: input ids and labels [seq_len] (labels IGNORE_INDEX where a token
    is not a target), a packed sample's document of each position, and the positions
    that are not padding where some are (else every position is real)."""
    sample = {INPUT_IDS: input_ids, LABELS: labels}
    if documents is not None:
        sample[DOCUMENTS] = documents
    if real_tokens is not None:
        sample[REAL_TOKENS] = torch.as_tensor(real_tokens, dtype=torch.long)
    return sample


def with_label(sample: dict[str, torch.Tensor], desirable: torch.Tensor) -> dict[str, torch.Tensor]:
    """A token sample of an unpaired preference example, with its label (KTO)."""
    return {**sample, DESIRABLE: desirable}


def with_margin(sample: dict[str, torch.Tensor], margin: torch.Tensor) -> dict[str, torch.Tensor]:
    """A token sample of a preference pair, with the pair's margin."""
    return {**sample, MARGIN: margin}


def sample_positions(sample) -> tuple[int, int | None]:
    """A sample's positions and how many of them are not padding (None: it does not say);
    a preference pair's (a tuple of samples): both samples'."""
    if isinstance(sample, tuple):
        parts = [sample_positions(s) for s in sample]
        reals = [real for _, real in parts]
        return sum(n for n, _ in parts), None if None in reals else sum(reals)
    real = sample.get(REAL_TOKENS)
    return sample[INPUT_IDS].numel(), None if real is None else int(real)


class SourcesOf(NamedTuple):
    """Which source each row of a batch is from (`source` [B], a mixture's), and the
    sources' names: the per-source sums a loss adds to its extras."""

    source: torch.Tensor
    names: tuple[str, ...]

    def sums(self, per_token: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """`loss/<name>` (the loss summed over the source's loss tokens) and
        `loss_tokens/<name>` for every source, present in the batch or not (every rank
        reduces the same keys)."""
        per_sample = per_token.sum(dim=1)
        tokens = mask.sum(dim=1).to(per_sample.dtype)
        sums = {}
        for index, name in enumerate(self.names):
            mine = self.source.to(per_sample.device) == index
            sums[f"loss/{name}"] = per_sample[mine].sum()
            sums[f"loss_tokens/{name}"] = tokens[mine].sum()
        return sums


@runtime_checkable
class MixesSources(Protocol):
    """A dataset whose samples come from several named sources (`freetx.data.Mixture`):
    each sample carries `source`, its index into `source_names`, so that a recipe logs
    each source's loss."""

    source_names: Sequence[str]


def source_names(dataset: object) -> tuple[str, ...]:
    """A mixture's source names (`MixesSources`); () for any other dataset."""
    return tuple(dataset.source_names) if isinstance(dataset, MixesSources) else ()


class SplitsSequences(Protocol):
    """A part of each sequence per rank (context parallelism:
    `freetx.distributed.ContextShard`); the model reads it too (`forward(context=...)`)."""

    size: int

    def split(self, x: torch.Tensor) -> torch.Tensor: ...

    def check_length(self, length: int) -> None: ...


@dataclass
class TokenBatch:
    """Rows of tokens [B, T] and what a loss needs beside them (module docstring)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    documents: torch.Tensor | None = None  # a packed batch: each position's document
    sources: SourcesOf | None = None  # a mixture's: each row's source
    real_tokens: torch.Tensor | None = None  # [B]: positions that are not padding
    padding: torch.Tensor | None = None  # [B] bools: an evaluation shard's repeated rows
    context: SplitsSequences | None = None  # the shard it was split by (cp)

    @classmethod
    def collate(cls, samples: list[dict[str, torch.Tensor]], source_names=()) -> TokenBatch:
        """A loader's micro-batch of token samples (`source_names`: a mixture's)."""

        def stacked(key: str) -> torch.Tensor | None:
            return torch.stack([s[key] for s in samples]) if key in samples[0] else None

        source = stacked(SOURCE)
        sources = None if source is None else SourcesOf(source, tuple(source_names))
        return cls(
            stacked(INPUT_IDS),
            stacked(LABELS),
            stacked(DOCUMENTS),
            sources,
            stacked(REAL_TOKENS),
            stacked(PADDING),
        )

    @classmethod
    def of_completions(
        cls,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        trained: Sequence[Sequence[bool]] | None = None,
    ):
        """Rows of prompt + completion ids (input ids: all but the last; labels: the next
        token where it is the completion's and, for a multi-turn episode, one it sampled:
        `trained` per completion token; None: all), padded on the right to the longest."""
        rows = [[*p, *c] for p, c in zip(prompts, completions)]
        width = max(len(r) for r in rows) - 1
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for i, (row, prompt) in enumerate(zip(rows, prompts)):
            input_ids[i, : len(row) - 1] = torch.tensor(row[:-1])
            start = len(prompt) - 1  # the position whose next token is the completion's first
            targets = torch.tensor(row[len(prompt) :], dtype=torch.long)
            if trained is not None:
                targets[~torch.tensor(trained[i], dtype=torch.bool)] = IGNORE_INDEX
            labels[i, start : len(row) - 1] = targets
        real = torch.tensor([len(r) - 1 for r in rows])
        return cls(input_ids, labels, real_tokens=real)

    def prompts(self) -> list[list[int]]:
        """Each row's prompt: its tokens up to the first one with a label (the position
        whose next token is the first target), that one included; a row without labels:
        its tokens that are not padding."""
        labelled = self.labels != IGNORE_INDEX
        first = torch.where(labelled.any(dim=1), labelled.int().argmax(dim=1) + 1, -1)
        real = (
            torch.full_like(first, self.input_ids.shape[1])
            if self.real_tokens is None
            else self.real_tokens.to(first.device)
        )
        ends = torch.where(first > 0, first, real).tolist()
        return [row[:end] for row, end in zip(self.input_ids.tolist(), ends)]

    def tensors(self) -> dict[str, Any]:
        """The fields, by name (the context shard left out)."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "context"
        }

    def rows(self, index: slice) -> TokenBatch:
        """The rows `index` selects (a micro-batch of them; a preference batch's chosen
        rows), every per-row field with them (a mixture's sources too)."""
        sliced = {
            name: value[index]
            for name, value in self.tensors().items()
            if isinstance(value, torch.Tensor)
        }
        if self.sources is not None:
            sliced["sources"] = self.sources._replace(source=self.sources.source[index])
        return dataclasses.replace(self, **sliced)

    def to(self, device: torch.device) -> TokenBatch:
        """The batch on `device` (a mixture's sources stay where they are: logging)."""
        moved = {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.tensors().items()
        }
        return dataclasses.replace(self, **moved)

    def split(self, context: SplitsSequences | None) -> TokenBatch:
        """This rank's part of each sequence under context parallelism (`context`; None:
        the batch): input ids and labels split, documents whole (the keys' documents),
        real_tokens shared out (the ranks' parts add up to the batch's)."""
        if context is None:
            return self
        context.check_length(self.input_ids.shape[1])
        real = None if self.real_tokens is None else self.real_tokens / context.size
        return dataclasses.replace(
            self,
            input_ids=context.split(self.input_ids),
            labels=context.split(self.labels),
            real_tokens=real,
            context=context,
        )

    @classmethod
    def join(cls, batches: list[TokenBatch]) -> TokenBatch:
        """Micro-batches one after another, as one batch (a pipeline's step: its schedule
        splits them again, in the same order)."""
        first = batches[0]
        joined = {}
        for name, value in first.tensors().items():
            if isinstance(value, torch.Tensor):
                joined[name] = torch.cat([getattr(b, name) for b in batches])
            elif isinstance(value, SourcesOf):
                joined[name] = SourcesOf(
                    torch.cat([b.sources.source for b in batches]), value.names
                )
        return dataclasses.replace(first, **joined)

    def model_inputs(self) -> dict[str, Any]:
        """What a loss passes on to the model besides input ids and labels: a packed
        batch's documents, the context shard; and what it sums by: a mixture's sources."""
        inputs = {"documents": self.documents, "sources": self.sources, "context": self.context}
        return {k: v for k, v in inputs.items() if v is not None}

    def loss_tokens(self, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """The labels that are not ignored: the unit a summed loss is normalized by."""
        return (self.labels != ignore_index).sum()

    def real_positions(self) -> float:
        """The positions that are not padding (every position where the data does not say)."""
        if self.real_tokens is None:
            return float(self.input_ids.numel())
        return float(self.real_tokens.sum())

    def without_padding_rows(self) -> TokenBatch:
        """An evaluation batch whose repeated rows (`padding`) count no loss token."""
        if self.padding is None:
            return self
        labels = self.labels.masked_fill(self.padding[:, None].to(self.labels.device), IGNORE_INDEX)
        return dataclasses.replace(self, labels=labels)


# a precomputed reference's log-probs of a sample: [sum, loss tokens]
REFERENCE_LOGPS = "reference_logps"
Pair = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]  # (chosen, rejected) samples


@dataclass
class PreferenceBatch(TokenBatch):
    """Pairs as rows of one token batch: row 2i is pair i's chosen completion, row 2i + 1
    its rejected one (`collate_pairs`); `join` and `split` keep them so. With a
    precomputed reference, each row's reference log-probs ride along."""

    reference_logps: torch.Tensor | None = None  # [B, 2]: each row's (sum, loss tokens)
    # unpaired examples (KTO): row 2i example i, row 2i + 1 its mismatched KL row; [B] bools,
    # each row its example's label (desirable)
    desirable: torch.Tensor | None = None
    margins: torch.Tensor | None = None  # [B]: each row its pair's margin (0: none given)

    @classmethod
    def collate_pairs(cls, pairs: list[Pair], source_names=()) -> PreferenceBatch:
        """A loader's micro-batch of preference pairs (`freetx.data.PreferenceDataset`'s
        items), interleaved: row 2i pair i's chosen sample, row 2i + 1 its rejected one."""
        rows = [sample for pair in pairs for sample in pair]
        batch = cls.collate(rows, source_names)
        if REFERENCE_LOGPS in rows[0]:
            batch.reference_logps = torch.stack([row[REFERENCE_LOGPS] for row in rows])
        if DESIRABLE in rows[0]:
            batch.desirable = torch.stack([row[DESIRABLE] for row in rows])
        if MARGIN in rows[0]:
            batch.margins = torch.stack([row[MARGIN] for row in rows]).float()
        return batch

    def pair_margins(self) -> torch.Tensor | None:
        """[pairs]: each pair's margin, in the order the loss reads them (None: a packed
        batch's, which carries none)."""
        return None if self.margins is None else self.margins[0::2]

    def sequences(self, pad_id: int) -> torch.Tensor:
        """[B, T + 1] each row's whole token sequence, right-padded with `pad_id`: its input
        ids and after them its last label (the token the next-token shift leaves out of
        the inputs: a completion's end token), which a reward model's score reads."""
        rows, width = self.input_ids.shape
        real = (
            torch.full((rows,), width, device=self.input_ids.device)
            if self.real_tokens is None
            else self.real_tokens.to(self.input_ids.device)
        )
        positions = torch.arange(width + 1, device=self.input_ids.device)
        whole = torch.full((rows, width + 1), pad_id, dtype=self.input_ids.dtype,
                           device=self.input_ids.device)  # fmt: skip
        whole[:, :width] = torch.where(
            positions[None, :width] < real[:, None], self.input_ids, pad_id
        )
        last = self.labels.gather(1, (real - 1).clamp(min=0)[:, None])[:, 0]
        if (last == IGNORE_INDEX).any():
            raise ValueError("a row's last position has no label: its last token is unknown")
        whole[torch.arange(rows), real] = last
        return whole

    def chosen_rows(self) -> PreferenceBatch:
        """Rows 0, 2, 4, ...: each pair's chosen completion (an unpaired batch's examples)."""
        return self.rows(slice(0, None, 2))

    def rejected_rows(self) -> PreferenceBatch:
        """Rows 1, 3, 5, ...: each pair's rejected completion (an unpaired batch's KL rows)."""
        return self.rows(slice(1, None, 2))

    def num_pairs(self) -> torch.Tensor:
        """The pairs the batch holds, an evaluation shard's repeats left out: the unit a
        preference loss is summed over and normalized by."""
        return self.real_pairs().sum()

    def real_pairs(self) -> torch.Tensor:
        """[pairs] bools, in the order the loss reads them (pair by pair; a packed batch's
        row by row, then document by document): those that are no evaluation shard's
        repeat."""
        rows = self.input_ids.shape[0] // 2
        real = torch.ones(rows, dtype=torch.bool) if self.padding is None else ~self.padding[0::2]
        if self.documents is None:
            return real
        present = documents_present(self.documents)[0::2]  # a pack's pairs: its documents
        return real.to(present.device)[:, None].expand_as(present)[present]


collate_pairs = PreferenceBatch.collate_pairs  # a loader's collate_fn for preference pairs


def documents_present(documents: torch.Tensor) -> torch.Tensor:
    """[rows, documents] bools: which documents (0, 1, ... in each row; -1 on padding) of
    a packed batch each row holds."""
    count = int(documents.max()) + 1 if documents.numel() else 0
    held = torch.zeros(documents.shape[0], max(count, 0), dtype=torch.long, device=documents.device)
    return held.scatter_add_(1, documents.clamp(min=0), (documents >= 0).long()) > 0


# a precomputed teacher's top-k at each position of a sample: its ids and log-probs [T, k]
TEACHER_IDS, TEACHER_LOGPS = "teacher_ids", "teacher_logps"


@dataclass
class DistillBatch(TokenBatch):
    """Token rows with a precomputed teacher's top-k at each position (distillation's
    `teacher.precompute: top_k`): its token ids and log-probs [B, T, k]."""

    teacher_ids: torch.Tensor | None = None
    teacher_logps: torch.Tensor | None = None

    @classmethod
    def collate_teacher(cls, samples: list[dict[str, torch.Tensor]], source_names=()):
        """A loader's micro-batch of token samples carrying their teacher's top-k."""
        batch = cls.collate(samples, source_names)
        if TEACHER_IDS in samples[0]:
            batch.teacher_ids = torch.stack([s[TEACHER_IDS] for s in samples])
            batch.teacher_logps = torch.stack([s[TEACHER_LOGPS] for s in samples])
        return batch

    def model_inputs(self) -> dict[str, Any]:
        """TokenBatch's, and the teacher's top-k as (ids, log-probs) where the batch
        carries them (`teacher_top_k`: for the distillation loss, not the model)."""
        inputs = super().model_inputs()
        if self.teacher_ids is not None:
            inputs["teacher_top_k"] = (self.teacher_ids, self.teacher_logps)
        return inputs


@dataclass
class RolloutBatch(TokenBatch):
    """Completions of online RL's rollouts (GRPO) as rows of one token batch: each row a
    prompt then its completion, right-padded, the labels only on the completion's tokens
    (its end token included). Each row's `advantages`; for each label, the policy's
    log-probs when it generated (`old_logps`: when more than one optimizer step uses one
    generation) and the reference's (`ref_logps`: a KL term), both [B, T] or None."""

    advantages: torch.Tensor | None = None  # [B], or [B, T]: one per label (REINFORCE++)
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None

    @classmethod
    def of_rollouts(
        cls,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        advantages: torch.Tensor,
        trained: Sequence[Sequence[bool]] | None = None,
    ) -> RolloutBatch:
        """`TokenBatch.of_completions`'s rows, with each row's advantage."""
        batch = cls.of_completions(prompts, completions, trained)
        batch.advantages = advantages.float()
        return batch

    def completion_mask(self) -> torch.Tensor:
        """[B, T] bools: the labels that are completion tokens."""
        return self.labels != IGNORE_INDEX

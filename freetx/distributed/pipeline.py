"""Pipeline parallelism: a model's blocks split into stages over the `pp` ranks of a
(pp, dp, cp, tp) mesh, the micro-batches of an optimizer step run through them by
torch.distributed.pipelining's schedules.

The model is split into stages of consecutive blocks (`stage_blocks`: as even as the
blocks divide, or `distributed.pp_blocks_per_stage`); rank r of the pp ranks holds
stages r, r + pp, ... (`pp_stages_per_rank` of them; more than one for interleaved
1F1B), the first stage the embedding, the last the final norm, the head and the loss.
Each rank keeps only its stages' parameters (`SplitsIntoStages.keep_blocks`, their
names unchanged, so a checkpoint saved at one layout loads at any other), sharded by
FSDP2 over the stage's dp x cp ranks and sliced over tp as without stages.

An optimizer step's micro-batches (`gradient_accumulation_steps`) are the pipeline's
micro-batches: `schedule` runs their forwards and backwards in the configured order
(GPipe: every forward, then every backward; 1F1B: one forward, one backward once the
pipeline is full, so a stage keeps at most pp micro-batches' activations; interleaved
1F1B: the same over several smaller stages per rank, a smaller bubble for more sends).
Activations travel between stages (the hidden states, and an MoE model's router
statistics so that the router loss is the whole model's); labels and documents reach
every stage as keyword inputs. The last stage computes the loss inside its forward (the
output layer in chunks, as without stages) and records the sums to log, which `step`
shares with the other stages of its pipeline (one all-reduce over pp).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from freetx.data.batch import SourcesOf, TokenBatch
from freetx.distributed.groups import ParallelGroups
from freetx.errors import ConfigError
from freetx.models.protocol import SplitsIntoStages, require_hook


class PipelinedLoss(Protocol):
    """What a pipeline's last stage asks of the recipe's loss (`CrossEntropyLoss`): the
    output loss its forward takes, and the sums made of that forward's output."""

    def output_loss(self, labels: torch.Tensor, sources: SourcesOf | None = None) -> Any: ...

    def sums(
        self, output: Any, labels: torch.Tensor, sources: SourcesOf | None = None
    ) -> tuple[torch.Tensor, dict]: ...

    ignore_index: int  # the label of positions without loss


def stage_blocks(num_blocks: int, stages: int, given: list[int] | None = None) -> list[range]:
    """The blocks of each stage, first to last: `given` counts, or as even as `num_blocks`
    divide (the blocks left over go to the middle stages: the first also embeds, the
    last also computes the head and the loss)."""
    if given is not None:
        if sum(given) != num_blocks or min(given) < 1:
            raise ConfigError(
                f"distributed.pp_blocks_per_stage={list(given)} gives {sum(given)} blocks, and "
                f"the model has {num_blocks} (every stage needs at least one).",
                fix=f"Give block counts of at least 1 that add up to {num_blocks}, or leave "
                "pp_blocks_per_stage out for an even split.",
            )
        sizes = list(given)
    else:
        if num_blocks < stages:
            raise ConfigError(
                f"distributed.pp x pp_stages_per_rank makes {stages} pipeline stages, and the "
                f"model has {num_blocks} blocks: a stage needs at least one.",
                fix=f"Pick pp x pp_stages_per_rank at most {num_blocks}.",
            )
        base, extra = divmod(num_blocks, stages)
        sizes = [base] * stages
        middle = sorted(range(stages), key=lambda s: (abs(2 * s - (stages - 1)), s))
        for stage in middle[:extra]:
            sizes[stage] += 1
    starts = [sum(sizes[:i]) for i in range(stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def num_stages(cfg) -> int:
    """The pipeline's stages: pp ranks x pp_stages_per_rank (a `distributed:` section)."""
    return cfg.pp * cfg.pp_stages_per_rank


def check_micro_batches(cfg, micro_batches: int) -> None:
    """The schedule takes the optimizer step's micro-batches (gradient_accumulation_steps):
    1F1B at least one per stage, interleaved 1F1B in whole rounds (torch's rules)."""
    if cfg.pp == 1:
        return
    stages = num_stages(cfg)
    if cfg.pp_schedule == "1f1b" and micro_batches < stages:
        why = f"at least one per stage ({stages})"
    elif cfg.pp_schedule == "interleaved_1f1b" and micro_batches % max(1, micro_batches // cfg.pp):
        why = f"a multiple of pp={cfg.pp}, or fewer than pp"
    else:
        return
    raise ConfigError(
        f"distributed.pp_schedule={cfg.pp_schedule} runs the {micro_batches} micro-batch(es) of "
        f"an optimizer step (gradient_accumulation_steps) through the stages, and needs {why}.",
        fix=f"Set gradient_accumulation_steps to {stages} or more (batch_size follows: it is "
        "split over them), or pp_schedule=gpipe.",
    )


def check_stages(model: nn.Module | type) -> None:
    """distributed.pp > 1 needs a model that splits into stages (`SplitsIntoStages`): the
    model, or the class a config builds (`check_layout`, before launching)."""
    require_hook(
        model,
        SplitsIntoStages,
        "cannot be split into pipeline stages (freetx splits the native decoder's blocks), so "
        "distributed.pp > 1 cannot run it.",
        fix="Set distributed.pp=1 (fsdp alone shards it).",
    )


def rank_stages(pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stages pp rank `pp_rank` holds: pp_rank, pp_rank + pp, ... (torch's schedules'
    order: interleaved 1F1B loops over the ranks)."""
    return [pp_rank + k * pp for k in range(per_rank)]


def split_into_stages(
    model: nn.Module, cfg, groups: ParallelGroups, num_blocks: int
) -> list[range]:
    """Prune `model` to this rank's stages (`SplitsIntoStages.keep_blocks`); their blocks,
    in this rank's order. Refuses a model that cannot be split."""
    check_stages(model)
    pp, per_rank = groups.size("pp"), cfg.pp_stages_per_rank
    blocks = stage_blocks(num_blocks, num_stages(cfg), cfg.pp_blocks_per_stage)
    mine = [blocks[s] for s in rank_stages(groups.rank("pp"), pp, per_rank)]
    held = sorted(i for stage in mine for i in stage)
    model.keep_blocks(held, first=mine[0].start == 0, last=mine[-1].stop == num_blocks)
    return mine


class StageModule(nn.Module):
    """One stage as torch's PipelineStage runs it: the model's `forward_stage` over the
    stage's blocks; at the last stage, the loss (recorded for logging)."""

    def __init__(self, model: nn.Module, blocks: range, last: bool, pipeline: Pipeline) -> None:
        super().__init__()
        self.model = model
        self.blocks, self.last = blocks, last
        self.pipeline = [pipeline]  # a list: not a submodule

    def forward(self, x, *carry, labels, documents=None, source=None):
        pipeline = self.pipeline[0]
        sources = None if source is None else SourcesOf(source, pipeline.source_names)
        head = pipeline.loss.output_loss(labels, sources) if self.last else None
        out = self.model.forward_stage(
            x,
            *carry,
            blocks=self.blocks,
            documents=documents,
            output_loss=head,
            context=pipeline.context,
        )
        if not self.last:
            return out
        total, extras = pipeline.loss.sums(out, labels, sources)
        pipeline.record(total, extras)
        return total


SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}


class Pipeline:
    """This rank's stages and the schedule that runs them (`ParallelPlan.pipeline`)."""

    def __init__(
        self,
        model: nn.Module,
        blocks: list[range],
        groups: ParallelGroups,
        cfg,
        micro_batches: int,
        context=None,
        scaler=None,
        num_blocks: int = 0,
    ) -> None:
        from torch.distributed import pipelining

        self.groups, self.context, self.scaler = groups, context, scaler
        self.loss: PipelinedLoss | None = None
        self.source_names: tuple[str, ...] = ()  # a mixture's, of the batch running
        self.scale = torch.ones(())
        self.micro_batches = micro_batches
        self._records: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
        self._keys: list[str] | None = None
        pp, per_rank = groups.size("pp"), cfg.pp_stages_per_rank
        indices = rank_stages(groups.rank("pp"), pp, per_rank)
        self.stages = [
            pipelining.PipelineStage(
                StageModule(model, stage, stage.stop == num_blocks, self),
                index,
                num_stages(cfg),
                groups.runtime.device,
                group=groups.meshes["pp"].get_group(),
            )
            for index, stage in zip(indices, blocks)
        ]
        schedule = getattr(pipelining, SCHEDULES[cfg.pp_schedule])
        stages = self.stages if cfg.pp_schedule == "interleaved_1f1b" else self.stages[0]
        # the loss is already divided by the global batch's units: no scaling by micro-batches
        self.schedule = schedule(
            stages, n_microbatches=micro_batches, loss_fn=self._scaled, scale_grads=False
        )

    def _scaled(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = output * self.scale
        return loss if self.scaler is None else self.scaler.scale(loss)

    def record(self, total: torch.Tensor, extras: dict[str, torch.Tensor]) -> None:
        """The last stage's loss sum and extras of one micro-batch (`StageModule`)."""
        self._records.append((total.detach(), {k: v.detach() for k, v in extras.items()}))

    def step(self, batch: TokenBatch, loss: PipelinedLoss, scale: torch.Tensor):
        """Forward and backward of every micro-batch of `batch` through the stages, the
        summed loss multiplied by `scale` (the gradient ranks over the global units);
        the sums to log, on every rank of the pipeline."""
        self._run(self.schedule.step, batch, loss, scale)
        return self._shared()

    @torch.no_grad()
    def evaluate(self, batch: TokenBatch, loss: PipelinedLoss, rows: int):
        """The loss sums of `batch` (any number of rows), forward only, in groups of
        `rows` (the training's rows per optimizer step: the stages' shapes), the last
        group padded with rows that have no loss tokens."""
        source = None if batch.sources is None else batch.sources.source
        tensors = (batch.input_ids, batch.labels, batch.documents, source)
        fills = (0, loss.ignore_index, -1, 0)  # each tensor's padding
        for start in range(0, len(batch.input_ids), rows):
            part = [
                None if t is None else padded(t[start : start + rows], rows, fill)
                for t, fill in zip(tensors, fills)
            ]
            sources = None if source is None else SourcesOf(part[3], batch.sources.names)
            self._run(self.schedule.eval, TokenBatch(*part[:3], sources), loss, torch.ones(()))
        return self._shared()

    def _run(self, call, batch: TokenBatch, loss: PipelinedLoss, scale: torch.Tensor) -> None:
        """One schedule call; keeps its micro-batches' records (the last `micro_batches`:
        a stage's first call also runs its forward once on stand-in tensors to learn the
        shapes it sends, which records too)."""
        self.loss, self.scale = loss, scale
        kwargs = {"labels": batch.labels}
        if batch.documents is not None:
            kwargs["documents"] = batch.documents
        if batch.sources is not None:
            kwargs["source"] = batch.sources.source
            self.source_names = batch.sources.names
        before = len(self._records)
        call(batch.input_ids, target=batch.labels, return_outputs=False, **kwargs)
        if len(self._records) > before:  # the last stage
            self._records[before:] = self._records[-self.micro_batches :]

    def _shared(self) -> dict[str, torch.Tensor]:
        """The recorded sums, every rank of the pipeline the last stage's (one all-reduce
        over pp; the keys agreed once, over the host group)."""
        device = self.groups.runtime.device
        sums: dict[str, torch.Tensor] = {"loss": torch.zeros((), dtype=torch.float64)}
        for total, extras in self._records:
            sums["loss"] = sums["loss"] + total
            for name, value in extras.items():
                sums[name] = sums.get(name, 0) + value
        self._records = []
        if self._keys is None:
            everyone = self.groups.host().all_gather_object(sorted(sums))
            self._keys = sorted(set().union(*map(set, everyone)))
        values = torch.stack(
            [torch.as_tensor(sums.get(k, 0.0), dtype=torch.float64).to(device) for k in self._keys]
        )
        values = self.groups.all_reduce(values, over="pp")
        return dict(zip(self._keys, values.unbind()))


def padded(tensor: torch.Tensor, rows: int, fill: int) -> torch.Tensor:
    """`tensor` with rows of `fill` added up to `rows`."""
    missing = rows - len(tensor)
    if missing <= 0:
        return tensor
    return torch.cat([tensor, tensor.new_full((missing, *tensor.shape[1:]), fill)])

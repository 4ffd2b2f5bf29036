"""What every recipe's optimizer step does: accumulate gradients, then step.

Objective-agnostic: a recipe's `compute_loss(batch)` returns its loss *summed*
over the batch's units (loss tokens, samples, activation rows, ...) and further
sums to log; `count(batch)` says how many units the batch holds. The helpers
know nothing of labels or tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from freetx.data.batch import TokenBatch
from freetx.distributed import ParallelGroups, ParallelPlan
from freetx.distributed.pipeline import PipelinedLoss
from freetx.training.grad import clip_grad_norm
from freetx.training.meters import per_source_means

Batch = Any  # whatever the recipe's data loader yields
LossFn = Callable[[Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def count_over_ranks(groups: ParallelGroups, counts: list[torch.Tensor | int]) -> torch.Tensor:
    """The units of these micro-batches, summed over the ranks that hold different parts
    of the global batch (dp x cp: a collective), as float64."""
    total = sum(torch.as_tensor(c) for c in counts).to(torch.float64)
    return groups.all_reduce(total.reshape(1), over="dp_cp")[0]


def accumulate_gradients(
    plan: ParallelPlan,
    batches: list[Batch],
    compute_loss: LossFn,
    count: Callable[[Batch], torch.Tensor | int],
    loss: PipelinedLoss | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Forward and backward over the micro-batches of one global batch.

    Token batches (`TokenBatch`) come to the device first, each rank with its part of
    every sequence under context parallelism (`placed`). The units of all micro-batches
    on all data-parallel ranks are counted next (one all-reduce); every micro-batch's
    summed loss is divided by that total, so each unit weighs the same whatever the
    split over ranks and micro-batches. Gradients are communicated only on the last
    micro-batch. Under pipeline parallelism (`plan.pipeline`) the token micro-batches
    run joined through the stages by its schedule, with the recipe's `loss` (its
    output loss and sums at the last stage). Returns (the sums for logging, the global
    unit count that normalizes them).
    """
    batches = [placed(plan, b) for b in batches]
    total = count_over_ranks(plan.groups, [count(b) for b in batches])
    if plan.pipeline is not None:
        if loss is None:
            raise ValueError("accumulate_gradients: a pipeline needs the recipe's loss")
        scale = plan.gradient_ranks / total.clamp(min=1)
        joined = TokenBatch.join(batches)
        return plan.pipeline.step(joined, loss, scale.to(plan.runtime.device)), total
    sums = {"loss": torch.zeros((), device=plan.runtime.device)}
    for i, batch in enumerate(batches):
        with plan.gradient_sync(enabled=i == len(batches) - 1):
            with plan.autocast(), plan.offloaded_activations():
                summed, extras = compute_loss(batch)
            # DDP and FSDP average gradients over the dp (x cp) ranks: multiply back
            # a global batch without units (its loss is 0) divides by 1, not 0
            plan.scaler.scale(summed * plan.gradient_ranks / total.clamp(min=1)).backward()
        sums["loss"] += summed.detach()
        for name, value in extras.items():
            sums[name] = sums.get(name, 0) + value
    return sums, total


def placed(plan: ParallelPlan, batch: Batch) -> Batch:
    """A token batch on this rank's device, with its part of each sequence (cp); any
    other batch as it is (its recipe moves it)."""
    if not isinstance(batch, TokenBatch):
        return batch
    return batch.to(plan.runtime.device).split(plan.context)


@torch.no_grad()
def evaluation_sums(
    plan: ParallelPlan, batch: TokenBatch, loss, rows: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """An evaluation batch's loss sums (`loss.evaluate`: the loss and its metrics) and
    its loss tokens, an evaluation shard's repeated rows left out; under pipeline
    parallelism through the stages, in groups of `rows` (the training's rows per
    optimizer step on this rank: the stages' shapes)."""
    batch = placed(plan, batch).without_padding_rows()
    with plan.autocast():
        if plan.pipeline is not None:
            parts = plan.pipeline.evaluate(batch, loss, rows)
        else:  # the loss runs the forward pass (its output layer in chunks)
            total, parts = loss.evaluate(
                plan.model, batch.input_ids, batch.labels, **batch.model_inputs()
            )
            parts = {"loss": total, **parts}
    return parts, batch.loss_tokens()


def validation_means(
    plan: ParallelPlan, batches, loss, rows: int, perplexity_of: str = "loss"
) -> dict[str, float]:
    """A token validation's metrics: every sum `evaluation_sums` gives, over `batches` and
    the dp and cp ranks (a collective: every rank takes part), per loss token, as
    `val/<name>` (a mixture's `val/loss/<source>` per source's token: `per_source_means`),
    and `val/perplexity`, exp of `val/<perplexity_of>`."""
    sums, tokens = {}, torch.zeros((), device=plan.runtime.device)
    for batch in batches:
        parts, loss_tokens = evaluation_sums(plan, batch, loss, rows)
        for name, value in parts.items():
            sums[name] = sums.get(name, 0) + value
        tokens += loss_tokens
    totals = plan.groups.sum({**sums, "tokens": tokens}, over="dp_cp")
    num_tokens = max(totals.pop("tokens"), 1.0)
    metrics = {f"val/{name}": value / num_tokens for name, value in totals.items()}
    metrics = per_source_means(metrics, prefix="val/")  # a mixture's: each source's
    metrics["val/perplexity"] = math.exp(min(metrics[f"val/{perplexity_of}"], 50.0))
    return metrics


def optimizer_step(
    plan: ParallelPlan, optimizer, lr_scheduler, max_grad_norm: float | None
) -> float:
    """Unscale (float16 only), clip to the global norm, step, update the scaler, advance
    the schedule. Returns the gradient norm before clipping (the same on every rank). A
    non-finite norm means a NaN or Inf somewhere: the update is skipped."""
    plan.scaler.unscale_(optimizer)
    grad_norm = clip_grad_norm(plan.model, max_grad_norm, plan.groups, optimizer)
    if math.isfinite(grad_norm) or plan.scaler.is_enabled():  # the scaler skips inf itself
        plan.scaler.step(optimizer)
    else:  # a NaN or Inf loss or gradient: no update (TrainingRun.advance decides the rest)
        optimizer.zero_grad(set_to_none=True)
    plan.scaler.update()
    plan.after_optimizer_step()
    lr_scheduler.step()
    return grad_norm

"""What every recipe's optimizer step does: accumulate gradients, then step."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from freetx.distributed.parallelize import autocast, gradient_sync
from freetx.distributed.runtime import DistributedRuntime
from freetx.training.grad import clip_grad_norm
from freetx.training.loss import count_tokens


def optimizer_step(
    model: nn.Module, optimizer, scaler, lr_scheduler, max_grad_norm: float | None
) -> float:
    """Unscale (float16 only), clip to the global norm, step, update the scaler, advance
    the schedule. Returns the gradient norm before clipping."""
    scaler.unscale_(optimizer)
    grad_norm = clip_grad_norm(model, max_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    lr_scheduler.step()
    return grad_norm


def accumulate_gradients(
    model: nn.Module,
    batches: list[dict[str, torch.Tensor]],
    compute_loss: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    runtime: DistributedRuntime,
    dist_cfg,
    scaler,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Forward and backward over the micro-batches of one global batch.

    `compute_loss(batch)` runs the model and returns (loss summed over the
    batch's loss tokens, further per-token sums). Gradients are communicated
    only on the last micro-batch; every loss is divided by the number of loss
    tokens (labels != IGNORE_INDEX) over all micro-batches and ranks, so each
    token weighs the same whatever the split. Returns (the per-token sums for
    logging, that token count).
    """
    num_tokens = count_tokens([b["labels"] for b in batches])
    sums = {"loss": torch.zeros((), device=runtime.device)}
    for i, batch in enumerate(batches):
        with gradient_sync(model, enabled=i == len(batches) - 1):
            with autocast(model, runtime, dist_cfg):
                loss, extras = compute_loss(batch)
            # DDP and FSDP average gradients over ranks: multiply back by the world size
            scaler.scale(loss * runtime.world_size / num_tokens).backward()
        sums["loss"] += loss.detach()
        for name, value in extras.items():
            sums[name] = sums.get(name, 0) + value
    return sums, num_tokens

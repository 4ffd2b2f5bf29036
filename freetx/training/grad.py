"""Gradient clipping by the global norm, for plain, DDP and FSDP2 (DTensor) models."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> float:
    """Clip all gradients to a global L2 norm of `max_norm` (None: only measure).

    With FSDP2 the gradients are DTensor shards and torch computes the norm
    over all ranks; the result is the same number on every rank.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    if max_norm is not None and max_norm > 0:  # else only measured: no pass over the grads
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)

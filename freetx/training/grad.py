"""Gradient clipping by the global norm, for plain, DDP and FSDP2 (DTensor) models."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from freetx.distributed import ParallelGroups
from freetx.distributed.optimizer import measured_norm


def clip_grad_norm(
    model: nn.Module,
    max_norm: float | None,
    groups: ParallelGroups | None = None,
    optimizer: Any = None,
) -> float:
    """Clip all gradients to a global L2 norm of `max_norm` (None: only measure).

    With FSDP2 the gradients are DTensor shards and torch computes the norm
    over all ranks; the result is the same number on every rank. Under pipeline
    parallelism each rank holds its stages' gradients: the squares are summed over the
    pp ranks (`groups`). An `optimizer` that measured the gradients in backward (offload,
    in_backward: their device copies are freed there) gives the norm, and its gradients
    (the host copies) are the ones clipped.
    """
    measured = measured_norm(optimizer)
    if measured is not None:
        grads, norm = measured.gradients(), measured.gradient_norm()
    else:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = total_norm(grads)
    if groups is not None and groups.size("pp") > 1:
        norm = groups.all_reduce(norm.reshape(1).double() ** 2, over="pp")[0].sqrt()
        norm = norm.to(torch.float32)
    if max_norm is not None and max_norm > 0:  # else only measured: no pass over the grads
        scale_gradients(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return float(norm)


@torch.no_grad()
def scale_gradients(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every gradient by `factor` in place, on each rank's local values (the
    gradients of a tensor-parallel model live on two meshes, which one foreach call over
    DTensors cannot mix), one foreach call per device and dtype, as torch's clipping."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        by_kind.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), group in by_kind.items():
        torch._foreach_mul_(group, factor.to(device))


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all `grads` together, a plain tensor. DTensors on one mesh are taken
    together by torch; under tensor parallelism the gradients live on two meshes (the
    sliced layers' (dp, tp), the rest's dp), so each mesh's norm is taken whole and the
    norms are combined."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        by_mesh.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack(norms))

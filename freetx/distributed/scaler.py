"""The float16 loss scaler of every strategy (`ParallelPlan.scaler`).

torch's `GradScaler` looks for an Inf or NaN in the gradients it unscales and,
when it finds one, skips the optimizer step and halves the scale. Under FSDP2
(fsdp, zero2, hsdp) a gradient is a DTensor and each rank holds only its shard,
so one rank may see an Inf the others do not: left alone, that rank would skip
the step and halve its scale while the others step, and the replicas drift
apart. `GradScaler` here unscales each rank's local shards and takes the MAX of
the found-Inf flag over every rank (tensor-parallel ranks hold different slices too;
one collective of one number
per step, only when float16 is on), so every rank skips the same steps and
keeps the same scale as one process holding the whole gradients would.
Replicated strategies (ddp, zero1) hold the same gradients on every rank; the
agreement changes nothing there.

torch's own `ShardedGradScaler` was written for FSDP1 (flat local gradients)
and calls `dist.all_reduce` on the default group; freetx's collectives name
their axis (`ParallelGroups`), so the agreement goes through them.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor

from freetx.distributed.groups import ParallelGroups


class GradScaler(torch.amp.GradScaler):
    """torch's GradScaler whose Inf/NaN check is agreed over the `dp` ranks."""

    def __init__(self, groups: ParallelGroups, enabled: bool) -> None:
        super().__init__(groups.runtime.device_type, enabled=enabled)
        self.groups = groups

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale this rank's (local) gradients in place; the found-Inf flag, agreed
        over the data-parallel ranks, under the scale's device (torch's hook, called by
        `unscale_`)."""
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                if grad.dtype == torch.float16 and not allow_fp16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                grads[grad.device, grad.dtype].append(grad)
        with torch.no_grad():
            found = [found_inf]
            for (device, _), tensors in grads.items():
                flag = torch.zeros_like(found_inf, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(
                    tensors, flag, inv_scale.to(device)
                )
                found.append(flag.to(found_inf.device))
            # one rank's Inf is every rank's: the same skip and the same scale everywhere
            agreed = torch.stack(found).amax()
            found_inf.copy_(self.groups.all_reduce(agreed, op="max", over="world"))
        return {found_inf.device: found_inf}

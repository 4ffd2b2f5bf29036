"""The frozen-base decision, made once per model: which parameters never get an update,
which of them are kept in the compute dtype, and where a resume reads them from.

A fine-tuning run (LoRA, QLoRA, Spectrum) freezes most of the model. `frozen_base`
decides, from the model and its initial weights, everything that follows from
that; `TrainingRun` computes it and passes it to the checkpointer (what a
checkpoint holds, where the base is read from on resume), `parallelize` (frozen
bases of adapter layers stored in the compute dtype) and `estimate` (their bytes)
take the same object.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from freetx.distributed.parameters import canonical_name, self_stored
from freetx.models.protocol import FrozenInComputeDtype


@dataclass(frozen=True)
class FrozenBase:
    """What of a model trains (canonical parameter names; every other parameter is
    frozen) and what follows from it."""

    trainable: frozenset[str]  # the parameters that get updates
    # frozen parameters kept in the compute dtype: they need no fp32 master copy (the
    # plain frozen parameters of `FrozenInComputeDtype` modules, e.g. LoRA's base)
    in_compute_dtype: frozenset[str]
    # where the frozen parameters are read from again on resume (the run's initial
    # weights), so that checkpoints hold only the trainable ones; None: checkpoints hold
    # the whole model
    read_from: str | None = None

    def saved(self, name: str) -> bool:
        """Whether a checkpoint holds model entry `name` (canonical)."""
        return self.read_from is None or name in self.trainable


def frozen_base(model: nn.Module, initial_weights: str | None = None) -> FrozenBase:
    """The decision for `model` (meta or materialized, under any wrapper), whose base
    comes from `initial_weights` (None: randomly initialized, or a full checkpoint)."""
    stored = self_stored(model)  # kept in their own form (NF4), never cast
    trainable, frozen, in_compute = set(), set(), set()
    for module_name, module in model.named_modules():
        cast = isinstance(module, FrozenInComputeDtype) and module.frozen_in_compute_dtype
        for name, param in module.named_parameters(recurse=False):
            full = canonical_name(f"{module_name}.{name}" if module_name else name)
            (trainable if param.requires_grad else frozen).add(full)
            plain = param.dtype.is_floating_point and full not in stored
            if cast and not param.requires_grad and plain:
                in_compute.add(full)
    read_from = initial_weights if initial_weights and frozen else None
    return FrozenBase(frozenset(trainable), frozenset(in_compute), read_from)

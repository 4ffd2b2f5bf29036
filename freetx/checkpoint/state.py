"""What goes into a checkpoint, as `Stateful` objects DCP saves and loads.

    model         ModelState: get/set_model_state_dict (FSDP2 shards, DDP's
                  `module.` prefix stripped), so one layout serves every strategy
    optimizer     OptimizerState: get/set_optimizer_state_dict, keyed by parameter
                  name; ZeRO-1 saves each rank's partition under the same names; the
                  memory rungs' optimizers (offload, in_backward, state_dtype) the same
                  shape, so a run resumes with a rung switched on or off
    lr_scheduler  LRSchedulerState: the scheduler's own state_dict
    train         TrainState: step, epoch, tokens seen
    scaler        ScalerState: float16's loss scale and growth tracker (float16 runs only)
    dataloader    PerRankState: each rank's loader state under `rank_<r>`
    rng           PerRankState: each rank's python / numpy / torch / CUDA RNG

Per-rank entries are loaded from the same rank when the checkpoint has it and
from rank 0 otherwise (a resume at another world size): the data order is a
function of the global step, so rank 0's sampler position is everyone's.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import LambdaLR

from freetx.distributed.optimizer import StepsEachParameter, local_optimizer
from freetx.distributed.parallelize import unwrap


class ModelState(Stateful):
    """The model's parameters and persistent buffers, sharded as the model is; with
    `include`, only the entries whose names it accepts (e.g. the trainable ones of a
    fine-tuning run whose frozen base is read from its own file)."""

    def __init__(self, model: nn.Module, include: Callable[[str], bool] | None = None) -> None:
        self.model = model
        self.include = include

    def state_dict(self) -> dict[str, Any]:
        state = get_model_state_dict(self.model)
        if self.include is None:
            return state
        return {k: v for k, v in state.items() if self.include(k)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        options = StateDictOptions(strict=self.include is None)
        set_model_state_dict(self.model, state_dict, options=options)


class OptimizerState(Stateful):
    """The optimizer state keyed by parameter name (portable across strategies).

    ZeRO-1 keeps each rank's partition in a local optimizer; its entries are
    saved under their parameter names too, and `param_groups` list every
    parameter, so the same checkpoint loads into fsdp, ddp or zero1 at any
    world size. A load restores the per-parameter state (moments, step
    counts); the hyperparameters (lr, betas, weight decay, ...) stay the ones
    the run's config built, so a resume that changes them applies the change
    (the checkpointer lists it) instead of silently keeping the saved ones.
    """

    def __init__(self, model: nn.Module, optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.zero = local_optimizer(optimizer) is not optimizer  # ZeRO-1's: this rank's share

    def _local(self):
        return local_optimizer(self.optimizer)

    def _named(self) -> dict[str, Any]:
        """The local optimizer's state keyed by parameter name: torch's for an ordinary
        optimizer, its own for freetx's per-parameter ones (the same shape)."""
        local = self._local()
        if isinstance(local, StepsEachParameter):
            return local.named_state_dict()
        return get_optimizer_state_dict(self.model, local)

    def state_dict(self) -> dict[str, Any]:
        state = self._named()
        if self.zero:
            state["param_groups"] = self._all_param_groups(state["param_groups"])
        return state

    def _all_param_groups(self, local_groups: list[dict]) -> list[dict]:
        """ZeRO-1's groups as if one optimizer held every parameter (same on all ranks)."""
        names = {id(p): n for n, p in unwrap(self.model).named_parameters()}
        groups = []
        for full, local in zip(self.optimizer.param_groups, local_groups):
            group = {k: v for k, v in local.items() if k != "params"}
            group["params"] = [names[id(p)] for p in full["params"]]
            groups.append(group)
        return groups

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.zero:
            mine = set(self._named()["state"])
            state_dict = {
                "state": {k: v for k, v in state_dict["state"].items() if k in mine},
                "param_groups": [
                    {**g, "params": [n for n in g["params"] if n in mine]}
                    for g in state_dict["param_groups"]
                ],
            }
        configured = [_hyperparameters(g) for g in self._local().param_groups]
        if isinstance(self._local(), StepsEachParameter):
            self._local().load_named_state_dict(state_dict)
        else:
            set_optimizer_state_dict(self.model, self._local(), state_dict)
        for group, values in zip(self._local().param_groups, configured):
            group.update(values)


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


class LRSchedulerState(Stateful):
    """A LambdaLR's position; on load the lr is recomputed from the config's base lr.

    The saved state holds the step (`last_epoch`) and the base lrs of the run
    that saved it. After a load the base lrs are the optimizer's `initial_lr`
    (the config's lr) and each group's lr is base x multiplier(step), the same
    expression LambdaLR evaluates, so an unchanged config resumes bit for bit
    and a changed lr or schedule takes effect at once.
    """

    def __init__(self, scheduler: LambdaLR) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        scheduler = self.scheduler
        scheduler.load_state_dict(state_dict)
        groups = scheduler.optimizer.param_groups
        scheduler.base_lrs = [_copy(group["initial_lr"]) for group in groups]
        for group, base, multiplier in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
            lr = base * multiplier(scheduler.last_epoch)
            if torch.is_tensor(group["lr"]):  # torchao's optimizers keep lr as a tensor
                group["lr"].fill_(float(lr))
            else:
                group["lr"] = lr
        scheduler._last_lr = [_copy(group["lr"]) for group in groups]


def _copy(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value


@dataclass
class TrainState(Stateful):
    """Where training stands: optimizer steps taken, epoch, tokens seen."""

    step: int = 0
    epoch: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.epoch = int(state_dict["epoch"])
        self.tokens_seen = int(state_dict["tokens_seen"])


class ScalerState(Stateful):
    """The float16 loss scaler's state (scale, growth tracker, factors), the same on every
    rank. A checkpoint without one (saved by a bfloat16 or float32 run, resumed in float16)
    leaves the scaler at its initial scale: `Checkpointer.load` loads it only when there."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state_dict)


class PerRankState(Stateful):
    """A value each rank has its own of (data loader position, RNG states).

    Saved as `{"rank_<r>": bytes}`: the value serialized by `torch.save` as one
    opaque entry, read back with `torch.load(weights_only=True)` (tensors,
    numbers, strings, lists and dicts only: a checkpoint is data, never code).
    Before a load the checkpointer sets `source_rank`: this rank's own entry
    when the checkpoint has it, else rank 0's.
    """

    def __init__(self, rank: int, get: Callable[[], Any], put: Callable[[Any], None]) -> None:
        self.rank = rank
        self.get = get
        self.put = put
        self.source_rank = rank

    def state_dict(self) -> dict[str, Any]:
        if self.source_rank != self.rank:  # a load template: the loaded value replaces it
            return {f"rank_{self.source_rank}": None}
        buffer = io.BytesIO()
        torch.save(self.get(), buffer)
        return {f"rank_{self.rank}": buffer.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        blob = state_dict[f"rank_{self.source_rank}"]
        self.put(torch.load(io.BytesIO(blob), weights_only=True))
        self.source_rank = self.rank  # later saves write this rank's own entry

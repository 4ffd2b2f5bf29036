"""The ranks of a job by named axis, and every collective freetx runs on them.

    groups = build_groups(runtime, cfg.distributed)   # before data and model
    groups.dp_rank, groups.dp_size        # which share of the data this rank reads
    groups.sum({"loss": loss_sum})        # summed over the data-parallel ranks
    groups.all_reduce(flags, over="world")

Axes: `dp` (data parallel: the ranks that read different samples), `cp` (context
parallel: the ranks that hold different parts of the same sequences), `tp` (tensor
parallel: the ranks that hold slices of the same layers and read the same tokens),
`dp_cp` (dp and cp together: the ranks that hold different tokens of the global batch,
over which losses and token counts are summed and gradients averaged), `pp` (pipeline
parallel: the ranks that hold different stages of blocks), `dp_replicate` and
`dp_shard` (hsdp: the replicas, and the ranks one replica is sharded over), `ep` (expert
parallel: data-parallel ranks that hold different experts of each block and send each
other tokens), `expert_fsdp` (the ranks one expert is sharded over) and `world` (every
rank: agreement to stop, saves). Their sizes come from the run's `MeshShape`
(`freetx.distributed.mesh`), their process groups from the meshes it builds; an axis
as large as the world uses the default group, an axis of one rank runs no collective.
`mesh` is what FSDP2 shards over (1-D, or hsdp's 2-D).

Nothing outside `freetx.distributed` calls a `torch.distributed` collective:
recipes, data, training and checkpoints come here (`ParallelPlan.groups`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from freetx.distributed.mesh import MeshShape
from freetx.distributed.runtime import DistributedRuntime

Axis = Literal[
    "dp", "cp", "tp", "pp", "dp_cp", "dp_replicate", "dp_shard", "ep", "expert_fsdp", "world"
]
AXES = ("dp", "cp", "tp", "pp", "dp_cp", "dp_replicate", "dp_shard", "ep", "expert_fsdp", "world")
ReduceOp = Literal["sum", "max", "min"]
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass
class ParallelGroups:
    """This job's ranks by axis name (see the module docstring)."""

    runtime: DistributedRuntime
    # the degree of every axis; None: every rank data-parallel (a world without meshes)
    shape: MeshShape | None = None
    meshes: dict[str, DeviceMesh] = field(default_factory=dict)  # MeshShape.build's
    _host: Any = field(default=None, init=False, repr=False)  # a gloo group, made when asked

    def __post_init__(self) -> None:
        if self.shape is None:
            self.shape = MeshShape("fsdp", dp_shard=self.runtime.world_size)

    @property
    def mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards over (1-D, or hsdp's 2-D); None without one."""
        return self.meshes.get("fsdp")

    # -- where this rank is --------------------------------------------------
    def size(self, over: Axis = "dp") -> int:
        self._check(over)
        return self.shape.degree(over)

    def rank(self, over: Axis = "dp") -> int:
        self._check(over)
        if over in self.meshes:
            return self.meshes[over].get_local_rank()
        # an axis without a mesh of its own has one rank, or is the whole world
        return 0 if self.size(over) == 1 else self.runtime.rank

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The tensor-parallel mesh (distributed.tp > 1), else None."""
        return self.meshes["tp"] if self.size("tp") > 1 else None

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """The expert-parallel mesh (distributed.ep > 1), else None."""
        return self.meshes["ep"] if self.size("ep") > 1 else None

    @property
    def expert_mesh(self) -> DeviceMesh | None:
        """What FSDP2 shards each expert over with ep > 1 (dp_shard / ep x cp; hsdp: 2-D,
        with the replicas), else None."""
        return self.meshes["expert_fsdp"] if self.size("ep") > 1 else None

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks: which share of the data it reads."""
        return self.rank("dp")

    @property
    def dp_size(self) -> int:
        """How many ranks read different data (the global batch is split over them)."""
        return self.size("dp")

    def _check(self, over: str) -> None:
        if over not in AXES:
            raise ValueError(f"no parallel axis named {over!r}; the axes are {', '.join(AXES)}")

    def _group(self, over: Axis):
        """The process group of an axis (None: the default group, for an axis as large as
        the world)."""
        self._check(over)
        return self.meshes[over].get_group() if over in self.meshes else None

    def _active(self, over: Axis) -> bool:
        return dist.is_available() and dist.is_initialized() and self.size(over) > 1

    # -- collectives ----------------------------------------------------------
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = "sum", over: Axis = "dp"
    ) -> torch.Tensor:
        """Reduce `tensor` in place over the ranks of `over`; returns it."""
        if self._active(over):
            dist.all_reduce(tensor, op=_OPS[op], group=self._group(over))
        return tensor

    def sum_with_gradient(self, tensor: torch.Tensor, over: Axis = "cp") -> torch.Tensor:
        """`tensor` summed over the ranks of `over` as a new tensor, its gradient summed
        over them too (torch.distributed.nn): what each rank holds a part of (a sequence's
        log-probs over its context shards) made whole on every rank, for a loss every rank
        then computes alike."""
        if not self._active(over):
            return tensor
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(tensor, op=_OPS["sum"], group=self._group(over) or dist.group.WORLD)

    def all_gather(self, tensor: torch.Tensor, over: Axis = "dp") -> torch.Tensor:
        """[ranks, *shape]: every rank's `tensor` (the same shape on every rank)."""
        if not self._active(over):
            return tensor.unsqueeze(0)
        ranks = self.size(over)
        flat = tensor.contiguous().reshape(-1)
        gathered = flat.new_empty(ranks * flat.numel())  # gloo wants a flat output
        # torch 2.13 renamed all_gather_into_tensor (now a FutureWarning) all_gather_single
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, flat, group=self._group(over))
        return gathered.view(ranks, *tensor.shape)

    def reduce_scatter(self, tensor: torch.Tensor, over: Axis = "dp") -> torch.Tensor:
        """`tensor` [ranks, *shape] summed over the ranks of `over`: this rank's row of
        the sum, [*shape] (the backward of `all_gather`)."""
        if not self._active(over):
            return tensor[0]
        out = tensor.new_empty(tensor[0].numel())  # gloo wants flat tensors
        # torch 2.13 renamed reduce_scatter_tensor (now a FutureWarning) reduce_scatter_single
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(out, tensor.contiguous().reshape(-1), group=self._group(over))
        return out.view(tensor.shape[1:])

    def all_gather_varying(self, tensor: torch.Tensor, over: Axis = "dp") -> torch.Tensor:
        """Every rank's 1-D `tensor`, concatenated in rank order (lengths may differ)."""
        if not self._active(over):
            return tensor
        length = torch.tensor([tensor.numel()], device=tensor.device)
        lengths = self.all_gather(length, over).reshape(-1).tolist()
        padded = tensor.new_zeros(max(lengths))
        padded[: tensor.numel()] = tensor
        gathered = self.all_gather(padded, over)
        return torch.cat([gathered[i, :n] for i, n in enumerate(lengths)])

    def sum(self, values: dict[str, torch.Tensor], over: Axis = "dp") -> dict[str, float]:
        """Each scalar summed over the ranks (one collective for all of them)."""
        stacked = torch.stack(
            [
                v.detach().to(device=self.runtime.device, dtype=torch.float64)
                for v in values.values()
            ]
        )
        return dict(zip(values, self.all_reduce(stacked, over=over).tolist()))

    def sum_tensors(
        self, values: dict[str, torch.Tensor], over: Axis = "dp"
    ) -> dict[str, torch.Tensor]:
        """Tensors of any shape, each summed over the ranks (one collective for all), as
        float64 on the CPU."""
        flat = [v.detach().to(torch.float64).reshape(-1) for v in values.values()]
        joined = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)
        if self._active(over):
            joined = self.all_reduce(joined.to(next(iter(values.values())).device), over=over)
        parts = joined.cpu().split([f.numel() for f in flat])
        return {k: p.reshape(v.shape) for (k, v), p in zip(values.items(), parts)}

    def sum_and_max(
        self, sums: dict[str, torch.Tensor | float], maxes: dict[str, float], over: Axis = "dp"
    ) -> tuple[dict[str, float], dict[str, float]]:
        """`sums` summed and `maxes` maximized over the ranks, in one collective (an
        all-gather of both, reduced here): what a logged step needs, in one round trip."""
        device = self.runtime.device
        parts = [
            torch.as_tensor(v, device=device).to(torch.float64).reshape(1) for v in sums.values()
        ]
        parts.append(torch.tensor(list(maxes.values()), dtype=torch.float64, device=device))
        local = torch.cat(parts)  # one copy to the host below, not one per value
        if self._active(over):
            gathered = self.all_gather(local, over)
            local = torch.cat([gathered[:, : len(sums)].sum(0), gathered[:, len(sums) :].amax(0)])
        values = local.tolist()
        return dict(zip(sums, values[: len(sums)])), dict(zip(maxes, values[len(sums) :]))

    # -- host-side collectives (Python objects), on a gloo group of their own --------
    def host(self) -> HostGroup:
        """A gloo group beside the device's, for objects and barriers that must not wait
        behind device work (checkpoint metadata); made at the first call."""
        if self._host is None:
            self._host = HostGroup.new()
        return self._host

    def barrier(self, over: Axis = "world") -> None:
        """Wait until every rank of `over` arrives."""
        if self._active(over):
            dist.barrier(group=self._group(over))


class HostGroup:
    """A gloo process group for Python objects and barriers (all ranks)."""

    def __init__(self, group) -> None:
        self.group = group

    @classmethod
    def new(cls) -> HostGroup:
        active = dist.is_available() and dist.is_initialized()
        return cls(dist.new_group(backend="gloo") if active else None)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s `obj`, on every rank."""
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""
        if self.group is None:
            return [obj]
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def any(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank (every rank learns the same answer). A CPU
        tensor on gloo: no wait for the device's queued work."""
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        if self.group is not None:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def destroy(self) -> None:
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None

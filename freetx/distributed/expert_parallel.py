"""Expert parallelism (`distributed.ep`): each MoE block's experts spread over the `ep`
ranks of a group of data-parallel ranks, E / ep whole experts per rank, with the tokens
sent to their experts' rank and back by all-to-all.

    experts = apply_expert_parallel(model, groups.ep_mesh)   # after tp, before AC and FSDP2

Each expert tensor of a block (`GroupedExperts`: w1, w3 [E, F, H], w2 [E, H, F], and any
parameter of the module whose first dimension is its experts) becomes a DTensor sharded
along its experts (`Shard(0)`) over the `ep` mesh, so its name and global shape are
those of one process: a DCP checkpoint holds the same keys and shapes at every ep and
reshards between them. FSDP2 then shards each rank's experts over the ranks that hold
the same ones (`expert_fsdp`: dp / ep x cp; `ParallelGroups.expert_mesh`), which with
the ep mesh makes one 2-D mesh, as torchtitan's dp_shard_mod_ep.

The router is untouched: it runs on every rank's own tokens, so its statistics and the
load-balancing loss are those of the rank's micro-batch (summed over cp) as without
ep. Around the experts' forward (`ExpertParallel`, module hooks; the experts' own
forward is unchanged):

    dispatch  the (token, slot) rows arrive sorted by expert with `counts` [E]; the
              counts of each rank's experts go to that rank first (an all-to-all of
              ep x E / ep integers), then the rows (an all-to-all of the rows, each
              rank's share a run of them); the rows received are reordered from
              (source rank, local expert) to (local expert, source rank), and the
              experts compute E / ep groups of rows.
    combine   the inverse: rows back to (source rank, local expert) order, an all-to-all
              back to the ranks they came from, in the order they were sent.

Dropless: every (token, slot) row reaches its expert, however many an expert gets (no
capacity factor, no padding): the sums are those of one process, whatever the routing,
so gradients equal one process's; the price is all-to-alls of varying sizes (the
counts exchanged first) and an uneven load when the routing is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from freetx.errors import ConfigError
from freetx.models.moe import GroupedExperts


def expert_modules(model: nn.Module) -> dict[str, GroupedExperts]:
    """The model's grouped experts (native MoE blocks), by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, GroupedExperts)}


def check_expert_parallel(num_experts: int, ep: int, where: str = "the model") -> None:
    """ep > 1 needs experts to spread, and whole experts on every rank: `num_experts`
    (of every MoE block; 0: a dense model) divisible by ep. Made from a native decoder's
    config before launching (`check_layout`) and from the built model (`parallelize`)."""
    if ep == 1:
        return
    if num_experts == 0:
        raise ConfigError(
            f"distributed.ep={ep} spreads the experts of MoE blocks over ranks, and {where} "
            "has no native MoE block (freetx.models.moe: a native decoder with "
            "num_experts > 0; the generic transformers path keeps its experts whole).",
            fix="Set distributed.ep=1 (fsdp shards the model), or train a native MoE "
            "(model.num_experts, or an HF folder of a family freetx reads natively).",
        )
    if num_experts % ep:
        divisors = [n for n in range(2, num_experts + 1) if num_experts % n == 0]
        raise ConfigError(
            f"distributed.ep={ep} gives each rank num_experts / ep whole experts, and {where} "
            f"has {num_experts} experts per MoE block, which do not divide into {ep}.",
            fix=f"Pick an ep that divides {num_experts} ({', '.join(map(str, divisors))}), "
            "or set distributed.ep=1.",
        )


def check_same_forwards(ep: int, what: str) -> None:
    """ep > 1 runs collectives in every forward (the all-to-alls of each MoE block), so
    every rank of an ep group must run as many forwards: refuse `what` (generation,
    lm-eval scoring: each rank its own rows, stopping when they end) with ep > 1."""
    if ep > 1:
        raise ConfigError(
            f"distributed.ep={ep}: {what} runs forwards that differ between ranks (each its "
            "own rows, until they end), and expert parallelism sends every forward's tokens "
            "to the experts of the other ranks of its ep group, which would wait for "
            "forwards that never come.",
            fix="Set distributed.ep=1 for this run (a checkpoint saved at any ep loads), "
            "or shard the experts with fsdp alone.",
        )


class ExpertParallel(ParallelStyle):
    """The parallel style of one `GroupedExperts` module over an ep mesh: its parameters
    sharded along the experts, its input rows dispatched to their experts' ranks and its
    output rows combined back (the module docstring). One instance per module: it keeps
    a forward's routes (what dispatch sent and received) until that forward's combine."""

    def __init__(self) -> None:
        super().__init__()
        self.routes: _Routes | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _shard_experts, self._dispatch, self._combine)

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        rows, counts = inputs
        self.routes = _Routes.exchange(torch.as_tensor(counts, device=rows.device), mesh)
        return self.routes.dispatch(rows), self.routes.local_counts

    def _combine(self, module: nn.Module, output: torch.Tensor, mesh: DeviceMesh):
        routes, self.routes = self.routes, None
        return routes.combine(output)


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Every parameter of the experts module (and of its submodules: an adapter's
    per-expert tensors) sharded along dimension 0, its experts."""
    for local, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param, mesh, [Shard(0)])
        module.register_parameter(local, nn.Parameter(sharded, requires_grad=param.requires_grad))


class _Routes:
    """Where one forward's rows go: how many this rank sends to each ep rank (`sent`) and
    gets from each (`received`), and the order that puts the received rows by local
    expert (`order`)."""

    def __init__(
        self,
        group,
        sent: list[int],
        received: list[int],
        order: torch.Tensor,
        local_counts: list[int],
    ) -> None:
        self.group, self.sent, self.received = group, sent, received
        self.order, self.local_counts = order, local_counts

    @classmethod
    def exchange(cls, counts: torch.Tensor, mesh: DeviceMesh) -> _Routes:
        """The counts [E] of this rank's rows per expert sent to the experts' ranks (one
        all-to-all of E integers): what every rank then sends and receives."""
        ranks, group = mesh.size(), mesh.get_group()
        counts = counts.to(torch.int64)
        per_rank = counts.numel() // ranks
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=group)
        incoming = incoming.view(ranks, per_rank)  # [source rank, local expert]
        sent = counts.view(ranks, per_rank).sum(1).tolist()
        received = incoming.sum(1).tolist()
        return cls(group, sent, received, expert_major(incoming), incoming.sum(0).tolist())

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows (sorted by expert) -> the rows of its experts (sorted by expert)."""
        arrived = all_to_all_single_autograd(
            rows.contiguous(), self.received, self.sent, self.group
        )
        return arrived[self.order]

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """The experts' output rows -> this rank's rows, in the order it dispatched them."""
        back = torch.empty_like(self.order)
        back[self.order] = torch.arange(len(self.order), device=self.order.device)
        return all_to_all_single_autograd(
            out[back].contiguous(), self.sent, self.received, self.group
        )


def expert_major(incoming: torch.Tensor) -> torch.Tensor:
    """The order that puts rows received (source rank, local expert)-major, `incoming`
    [ranks, local experts] of them from each rank for each expert, expert-major (and by
    source rank within an expert): the indices of the received rows, in that order."""
    ranks, experts = incoming.shape
    sizes = incoming.reshape(-1)
    starts = (sizes.cumsum(0) - sizes).view(ranks, experts).t().reshape(-1)
    by_expert = incoming.t().reshape(-1)
    first = torch.repeat_interleave(starts, by_expert)
    within = torch.arange(int(by_expert.sum()), device=incoming.device)
    return first + within - torch.repeat_interleave(by_expert.cumsum(0) - by_expert, by_expert)


def check_model_experts(model: nn.Module, ep: int) -> None:
    """`check_expert_parallel` of a built (meta) model, whole (before pipeline stages
    prune it): refuses one without native experts, or whose experts do not divide by ep."""
    for size in {m.w1.shape[0] for m in expert_modules(model).values()} or {0}:
        check_expert_parallel(size, ep, type(model).__name__)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Spread every `GroupedExperts` of a (meta) model, checked by `check_model_experts`
    (a pipeline stage may hold none), over `ep_mesh` (`ExpertParallel`): returns them, for
    FSDP2 to shard over `expert_fsdp`."""
    experts = expert_modules(model)
    parallelize_module(model, ep_mesh, {name: ExpertParallel() for name in experts})
    return list(experts.values())

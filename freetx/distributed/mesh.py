"""The shape of a run's parallelism: how many ranks each axis has (`MeshShape`), every
refusal of a layout the processes cannot form, and one build of the device meshes.

    shape = MeshShape.of(cfg.distributed, Processes.of(runtime))
    shape.dp, shape.dp_cp, shape.fsdp     # the batch's, the loss's and FSDP2's ranks
    meshes = shape.build("cuda")          # {"pp", "dp", "cp", "tp", "dp_cp", "fsdp", ...}

The axes, outermost first, as torchtitan's ParallelDims: `pp` (pipeline stages),
`dp_replicate` (whole copies of the model: DDP's ranks, hsdp's replicas), `dp_shard`
(the ranks one copy is sharded over by FSDP2), `cp` (parts of each sequence), `tp`
(slices of each layer). Rank r sits at (pp, dp_replicate, dp_shard, cp, tp) with `tp`
fastest: the inner axes are the ranks of one node, where their traffic per block is
cheap; pipeline stages and replicas cross nodes. Every product of the degrees is
computed here and nowhere else.

Expert parallelism (`ep`) borrows its ranks from the data-parallel ones (hsdp: those of
each replica): dp_shard is split into (`dp_mod_ep`, `ep`), so the world is unchanged; the
mesh is (pp, [dp_replicate,] dp_mod_ep, cp, ep, tp), ep inside cp (an ep group's ranks are neighbours,
tp apart, where its all-to-alls are cheap). A block's experts are spread over `ep` (E /
ep whole experts per rank) and FSDP2 shards them over `expert_fsdp` (dp_mod_ep x cp: the
ranks holding the same experts), which with `ep` makes a 2-D mesh of dimensions in the
mesh's order (DTensor's collectives over both need that); everything else is sharded
over dp x cp as without it (torchtitan's dp_shard_mod_ep).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from freetx.errors import ConfigError

STRATEGY_ALIASES = {"zero3": "fsdp"}
REPLICATED = ("ddp", "zero1")  # every data-parallel rank holds whole parameters
# the strategies that shard over a mesh: FSDP2; fsdp and zero2 over dp_shard x cp, hsdp
# over (dp_replicate, dp_shard x cp)
SHARDED = ("fsdp", "zero2", "hsdp")
# the mesh axes a collective may name (`ParallelGroups`), beside `world`
AXIS_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
_WORDS = {
    "pp": "pipeline",
    "dp_replicate": "replicas",
    "cp": "context parallel",
    "tp": "tensor parallel",
    "ep": "expert parallel",
}
# the strategies expert parallelism composes with: FSDP2 (hsdp: within each replica)
EXPERT_PARALLEL_STRATEGIES = SHARDED


def canonical_strategy(name: str) -> str:
    return STRATEGY_ALIASES.get(name, name)


@dataclass(frozen=True)
class Processes:
    """Where a run's processes are, as far as it is known: `freetx validate` knows none
    of it, `freetx run` / `launch` know the processes before launching, a running rank
    knows everything (`Processes.of(runtime)`)."""

    world_size: int | None = None
    processes_per_node: int | None = None
    device_type: str | None = None  # cpu | cuda

    @classmethod
    def of(cls, runtime) -> Processes:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", runtime.world_size))
        return cls(runtime.world_size, per_node, runtime.device_type)

    def describe(self) -> str:
        nodes = self.world_size // self.processes_per_node if self.processes_per_node else None
        if nodes and nodes > 1:
            return f"{nodes} node(s) x {self.processes_per_node} processes"
        return f"{self.world_size} process(es)"


@dataclass(frozen=True)
class MeshShape:
    """The degree of every axis of a run (see the module docstring). The world is their
    product. `strategy` is the canonical strategy (fsdp, zero2, hsdp, ddp, zero1)."""

    strategy: str = "fsdp"
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # of the dp ranks (dp_shard), not a factor of the world

    # -- the ranks each part of the work spreads over ---------------------------------
    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def dp(self) -> int:
        """The data-parallel ranks: they read different samples (the batch's split)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """The ranks that hold different tokens of the global batch: losses and token
        counts are summed over them, gradients averaged."""
        return self.dp * self.cp

    @property
    def fsdp(self) -> int:
        """The ranks one copy of the parameters is sharded over (1: replicated)."""
        return self.dp_shard * self.cp

    @property
    def dp_mod_ep(self) -> int:
        """The data-parallel ranks of one replica that hold the same experts (dp_shard /
        ep; hsdp's replicas hold them again)."""
        return self.dp_shard // self.ep

    @property
    def expert_fsdp(self) -> int:
        """The ranks one expert is sharded over by FSDP2 (dp_shard / ep x cp, within a
        replica); `fsdp` without expert parallelism."""
        return self.dp_mod_ep * self.cp if self.ep > 1 else self.fsdp

    @property
    def per_data_rank(self) -> int:
        """The ranks of one data-parallel index (pp x cp x tp): they compute one
        micro-batch together, each a part of its work."""
        return self.pp * self.cp * self.tp

    @property
    def sequence_divisor(self) -> int:
        """What a sequence's length must divide by: 2 x cp chunks (two per context rank,
        for balanced causal attention); 1 without context parallelism."""
        return 2 * self.cp if self.cp > 1 else 1

    def check_sequence_length(self, length: int) -> None:
        """A sequence of `length` tokens splits into `sequence_divisor` equal chunks."""
        if length % self.sequence_divisor:
            cp, chunks = self.cp, self.sequence_divisor
            raise ConfigError(
                f"distributed.cp={cp} splits each sequence into 2 x {cp} equal chunks (two per "
                f"rank, for balanced causal attention), and seq_len={length} does not divide "
                f"into {chunks}.",
                fix=f"Set dataset.seq_len to a multiple of {chunks} (packed data fills it), or "
                "pick a cp that divides seq_len / 2.",
            )

    def degree(self, axis: str) -> int:
        """The ranks of a named axis: a mesh axis, `dp`, `dp_cp`, `fsdp` or `world`."""
        combined = {
            "dp": self.dp,
            "dp_cp": self.dp_cp,
            "fsdp": self.fsdp,
            "dp_mod_ep": self.dp_mod_ep,
            "expert_fsdp": self.expert_fsdp,
            "world": self.world_size,
        }
        return combined[axis] if axis in combined else getattr(self, axis)

    @property
    def has_axes(self) -> bool:
        """Whether any axis besides data parallelism has more than one rank."""
        return self.per_data_rank > 1

    # -- in words ----------------------------------------------------------------------
    def grid(self) -> str:
        """The axes besides the data-parallel ranks, for the banner: ` x pipeline 2 x
        tensor parallel 2` ('' when there are none)."""
        replicas = ("dp_replicate",) if self.strategy == "hsdp" else ()
        shown = ("pp", *replicas, "cp", "tp", "ep")
        return "".join(f" x {_WORDS[a]} {n}" for a in shown if (n := getattr(self, a)) > 1)

    def describe(self) -> str:
        """The strategy and any other axis, in words (checkpoints' meta): `fsdp x cp 2 x tp 2`."""
        axes = [f"{axis} {getattr(self, axis)}" for axis in ("pp", "cp", "tp", "ep")]
        return " x ".join([self.strategy] + [a for a in axes if not a.endswith(" 1")])

    # -- the meshes ---------------------------------------------------------------------
    def needs_mesh(self, cpu_offload: bool = False) -> bool:
        """Whether the run shards over a device mesh (FSDP2, or any axis besides dp);
        DDP and a plain model use the default process group."""
        sharded = self.strategy in SHARDED and (self.world_size > 1 or cpu_offload)
        return sharded or self.has_axes or self.ep > 1

    def build(self, device_type: str) -> dict[str, DeviceMesh]:
        """The meshes the code asks for, by name: each axis of more than one rank (`pp`,
        `cp`, `tp`, `dp_replicate`, `dp_shard`), `dp` (the batch's ranks), `dp_cp` (the
        loss's) and `fsdp` (what FSDP2 shards over: 1-D, or hsdp's 2-D (dp_replicate,
        dp_shard x cp)); with ep > 1 also `dp_mod_ep`, `ep` and `expert_fsdp` (what FSDP2
        shards the experts over). Every rank calls it at once (it makes process groups)."""
        replicas = self.dp_replicate > 1 and self.strategy == "hsdp"
        if self.ep > 1:
            return self._build_with_experts(device_type)
        if not self.has_axes:  # one data-parallel axis: 1-D, or hsdp's 2-D
            if not replicas:
                mesh = init_device_mesh(device_type, (self.dp,), mesh_dim_names=("dp_shard",))
                return {"fsdp": mesh}
            names = ("dp_replicate", "dp_shard")
            shape = (self.dp_replicate, self.dp_shard)
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
            return {"fsdp": mesh, **{name: mesh[name] for name in names}}
        if not replicas:  # (pp, dp, cp, tp): dp is one axis
            data_dims = {"dp": self.dp}
        else:
            data_dims = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard}
        dims = {"pp": self.pp, **data_dims, "cp": self.cp, "tp": self.tp}
        mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
        meshes = {name: mesh[name] for name in dims}
        data = ("dp_replicate", "dp_shard") if replicas else ("dp",)
        if replicas:
            meshes["dp"] = mesh[data]._flatten("dp")
        meshes["dp_cp"] = mesh[(*data, "cp")]._flatten("dp_cp") if self.cp > 1 else meshes["dp"]
        if not replicas:
            meshes["fsdp"] = meshes["dp_cp"]
        else:  # hsdp: replicas outside, FSDP2 shards within a replica over dp_shard x cp
            shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp") if self.cp > 1 else None
            meshes["fsdp"] = mesh["dp_replicate", "dp_shard_cp" if shard else "dp_shard"]
        if self.tp > 1:  # a 2-D parameter's norm: one all-reduce over the flattened axes
            mesh[(*data, "cp", "tp")]._flatten("dp_cp_tp")
        return meshes

    def _build_with_experts(self, device_type: str) -> dict[str, DeviceMesh]:
        """`build` with ep > 1: (pp, [dp_replicate,] dp_mod_ep, cp, ep, tp), dp_shard the
        flattened (dp_mod_ep, ep). FSDP2 shards an expert over dp_mod_ep x cp (hsdp: 2-D,
        replicated over dp_replicate: `expert_fsdp`), which with the experts' `ep` makes
        one mesh of dimensions in this mesh's order (DTensor's collectives need that)."""
        hsdp = self.strategy == "hsdp" and self.dp_replicate > 1
        replicas = {"dp_replicate": self.dp_replicate} if hsdp else {}
        inner = {"dp_mod_ep": self.dp_mod_ep, "cp": self.cp, "ep": self.ep, "tp": self.tp}
        dims = {"pp": self.pp, **replicas, **inner}
        mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
        meshes = {name: mesh[name] for name in dims}
        outer = tuple(replicas)  # ("dp_replicate",) or ()
        meshes["dp"] = mesh[(*outer, "dp_mod_ep", "ep")]._flatten("dp")
        shard, experts = "dp_shard", "dp_mod_ep"  # within a replica: all, and the experts'
        meshes["dp_shard"] = mesh[("dp_mod_ep", "ep")]._flatten(shard) if hsdp else meshes["dp"]
        meshes["dp_cp"] = meshes["dp"]
        if self.cp > 1:
            meshes["dp_cp"] = mesh[(*outer, "dp_mod_ep", "cp", "ep")]._flatten("dp_cp")
            shard, experts = "dp_shard_cp", "dp_mod_ep_cp"
            if hsdp:
                mesh[("dp_mod_ep", "cp", "ep")]._flatten(shard)
            mesh[("dp_mod_ep", "cp")]._flatten(experts)
        meshes["fsdp"] = mesh[(*outer, shard)] if hsdp else meshes["dp_cp"]
        meshes["expert_fsdp"] = mesh[(*outer, experts)]
        if self.tp > 1:
            mesh[(*outer, "dp_mod_ep", "cp", "ep", "tp")]._flatten("dp_cp_tp")
        return meshes

    # -- the shape a config makes ---------------------------------------------------------
    @classmethod
    def of(cls, cfg, processes: Processes = Processes()) -> MeshShape:
        """The shape a `distributed:` section makes on `processes`'s processes, after every
        refusal of it (those needing the world or the node size only where `processes`
        knows them). Where the world is not known (`freetx validate`), the smallest
        world the config fits: one data-parallel rank per replica."""
        strategy = canonical_strategy(cfg.strategy)
        inner = cls(strategy, cfg.pp, 1, 1, cfg.cp, cfg.tp)
        inner.refuse_axes(cfg.strategy, processes)
        ep = cfg.ep
        world = processes.world_size
        if ep > 1:
            inner.refuse_experts(cfg.strategy, ep)
        if world is None:  # with ep: the smallest world of one expert-parallel group
            replicas = (cfg.replicate_degree or 1) if strategy == "hsdp" else 1
            return cls(strategy, cfg.pp, replicas, ep, cfg.cp, cfg.tp, ep)
        dp = world // inner.per_data_rank
        if strategy in REPLICATED:
            return cls(strategy, cfg.pp, dp, 1, cfg.cp, cfg.tp)
        replicas = 1
        if strategy == "hsdp":
            replicas = inner.replicas(cfg.replicate_degree, dp, processes)
        if ep > 1:
            inner.refuse_expert_ranks(ep, dp // replicas, replicas)
        return cls(strategy, cfg.pp, replicas, dp // replicas, cfg.cp, cfg.tp, ep)

    def refuse_experts(self, named_strategy: str, ep: int) -> None:
        """distributed.ep: the strategies it composes with (FSDP2)."""
        if self.strategy not in EXPERT_PARALLEL_STRATEGIES:
            raise ConfigError(
                f"distributed.ep={ep} spreads each block's experts over {ep} data-parallel "
                "ranks, and FSDP2 shards them over the others (a (dp / ep, ep) mesh): it "
                f"composes with fsdp, zero2 or hsdp, not {named_strategy}.",
                fix="Use distributed.strategy=fsdp (or hsdp for replicas), or set "
                "distributed.ep=1.",
            )

    def refuse_expert_ranks(self, ep: int, shards: int, replicas: int) -> None:
        """An ep that divides the `shards` data-parallel ranks of a replica (all of them
        without hsdp's `replicas`)."""
        if shards % ep:
            per = f" (world / {self.per_data_rank}: pp x cp x tp)" if self.has_axes else ""
            where = f"of each of its {replicas} hsdp replicas" if replicas > 1 else "of this run"
            raise ConfigError(
                f"distributed.ep={ep} takes its ranks from the data-parallel ones, and does "
                f"not divide the {shards} data-parallel rank(s){per} {where}, so the experts "
                "cannot be spread over groups of ep ranks.",
                fix=f"Pick an ep that divides {shards} (and the model's num_experts), or run "
                f"on a multiple of {ep * self.per_data_rank * replicas} processes.",
            )

    def refuse_axes(self, named_strategy: str, processes: Processes) -> None:
        """pp, cp and tp: the strategies they compose with, a tp inside a node, and a
        product that divides the processes."""
        axes = {name: n for name in ("pp", "cp", "tp") if (n := getattr(self, name)) > 1}
        if not axes:
            return
        named = " and ".join(f"distributed.{name}={n}" for name, n in axes.items())
        reset = " and ".join(f"{name}=1" for name in axes)
        s = "" if len(axes) > 1 else "s"  # distributed.tp=2 composes; tp=2 and cp=2 compose
        if self.strategy in REPLICATED:
            raise ConfigError(
                f"{named} compose{s} with fsdp, zero2 or hsdp (FSDP2 over the data-parallel "
                f"ranks of a (pp, dp, cp, tp) mesh), not {named_strategy}.",
                fix=f"Use distributed.strategy=fsdp (or hsdp for replicas), or set {reset}.",
            )
        per_node = processes.processes_per_node
        nodes = (processes.world_size or 0) > (per_node or 0)  # one node: the check below
        if per_node is not None and nodes and per_node % self.tp:
            raise ConfigError(
                f"distributed.tp={self.tp} does not divide the {per_node} process(es) per node "
                "of this run: a tp group would span nodes, and its two sums per block and "
                "pass would cross the slow link.",
                fix="Pick a tp that divides the processes (GPUs) of one node, e.g. tp=8 with "
                "8 per node, or set distributed.tp=1.",
            )
        if processes.world_size is not None and processes.world_size % self.per_data_rank:
            product = " x ".join(f"{name} {n}" for name, n in axes.items())
            raise ConfigError(
                f"{named} need{s} {self.per_data_rank} processes per data-parallel rank "
                f"({product}), which does not divide the {processes.describe()} of this run, so "
                "they cannot form a (pp, dp, cp, tp) mesh.",
                fix=f"Pick sizes whose product divides the number of processes (e.g. tp=2 or "
                f"cp=2 on 4: 2 x 2), or set {reset}.",
            )

    def replicas(self, configured: int | None, dp: int, processes: Processes) -> int:
        """hsdp's replicas among `dp` data-parallel ranks: the configured degree, else
        one per node (the data-parallel ranks of a node shard one copy)."""
        degree = configured
        per_node = processes.processes_per_node
        if degree is None and per_node and per_node < (processes.world_size or 0):
            shards = max(1, per_node // (self.cp * self.tp))  # a node's data-parallel ranks
            degree = max(1, dp // shards)
        degree = degree or 1
        if dp % degree:
            inner = f" ({self.per_data_rank} processes each)" if self.has_axes else ""
            raise ConfigError(
                f"hsdp: a replicate degree of {degree} does not divide the {dp} data-parallel "
                f"ranks{inner} of the {processes.describe()} of this run, so they cannot form a "
                "replicas x shards mesh.",
                fix="Pick a distributed.replicate_degree (estimate: --replicas) that divides the "
                "number of data-parallel ranks, e.g. the number of nodes.",
            )
        return degree

"""`freetx estimate --measure`: one training step of a config's micro-batch on fake tensors
and a fake process group, under torch's memory trackers (what rank 0 holds at its peak,
by column of `freetx.planning.estimate.Estimate`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from freetx.config import instantiate
from freetx.distributed import (
    DistributedRuntime,
    MeshShape,
    ParallelGroups,
    StateSharding,
    fake_world,
    parallelize,
)
from freetx.planning.config import meta_model, planned_run

# the trackers' categories (FSDPMemTracker's and MemTracker's names) -> the estimate's columns
_COLUMNS = {
    "Sharded Param": "parameters", "Parameter": "parameters",
    "Sharded Grad": "gradients", "Gradient": "gradients",
    "OptState": "optimizer", "Optstate": "optimizer",
    "Unsharded Param": "gathered", "Unsharded Grad": "gathered",
    "All Gather": "gathered", "Reduce Scatter": "gathered",
}  # fmt: skip


def measure(cfg, shape: MeshShape) -> dict[str, float]:
    """`--measure`: the bytes rank 0 holds at the peak of one training step of the config's
    micro-batch under a strategy's `shape` (no other axis), with exact tensor sizes and no real memory or compute.

    The step runs as rank 0 of `world_size` in this one process: tensors are fake (shapes,
    dtypes, no storage: torch's FakeTensorMode), collectives do nothing (the "fake"
    process group), and torch's memory trackers (FSDPMemTracker for FSDP2, MemTracker
    otherwise) count every tensor alive, by kind. A first step creates the optimizer
    state; the second is the one measured, as every later step of a run. The kernels
    are this machine's: CUDA's where there is a GPU, else the CPU's (whose RMSNorm keeps
    float32 intermediates that CUDA's fused kernel does not: ~10 h bytes per token and
    block more). DDP's gradient hooks do not run on the fake group: replicated layouts
    (ddp, zero1) measure the plain model (DDP's buckets are the gradients themselves, as
    views, kept between steps: added to `gathered`), with the optimizer state divided by
    the ranks sharing it. Blocks run uncompiled (Dynamo does not trace the fake step: it
    crashed the process). Returns bytes per column of `Estimate`, and `peak`.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    layout, world_size = StateSharding.of(shape), shape.world_size
    sharded = layout.parameter_shards > 1  # else replicated: the plain model at world size 1
    distributed = dataclasses.replace(
        cfg.distributed,
        strategy=shape.strategy,
        replicate_degree=shape.dp_replicate,  # read by hsdp alone
        compile=False,  # Dynamo cannot trace fake tensors under the trackers (it crashed)
        async_tp=False,  # a pass of compile's
    )
    planned = planned_run(cfg)
    micro = cfg.batch_size // (shape.dp * cfg.gradient_accumulation_steps)
    if not sharded:  # the plain model: one process's shape
        shape = MeshShape(shape.strategy, dp_replicate=1)
    with fake_world(world_size):
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        runtime = DistributedRuntime(0, 0, shape.world_size, device)
        meshes = shape.build(device.type) if sharded else {}
        model = meta_model(planned.model, planned.adapters)  # real meta tensors
        with FakeTensorMode(allow_non_fake_inputs=True):
            groups = ParallelGroups(runtime, shape, meshes)
            plan = parallelize(model, groups, distributed, seed=cfg.seed)
            optimizer = plan.build_optimizer(cfg.optimizer)
            loss_fn = instantiate(planned.loss)
            size = (micro, planned.seq_len)
            input_ids = torch.randint(0, model.config.vocab_size, size, device=device)
            out = tracked_step(plan, optimizer, loss_fn, input_ids, layout)
    if layout.all_reduce and world_size > 1:  # DDP's buckets, kept between steps
        buckets = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
        out["gathered"] += buckets
        out["peak"] += buckets
    return out


@contextlib.contextmanager
def _gradients_in_forward(tracker) -> Iterator[None]:
    """The chunked loss (`freetx.models.chunked_loss`) takes each chunk's gradients inside
    forward (`torch.autograd.grad`); torch's module tracker, under the memory trackers,
    takes the end of that for the end of the step's backward and forgets which modules
    are running (the next chunk then fails as "multiple iterative calls"). While forward
    runs, the tracker's end-of-backward callback is held back; the step's own backward
    ends it as always."""
    if tracker is None:
        yield
        return
    modules = tracker._mod_tracker
    modules._maybe_set_engine_callback = lambda: None  # shadows the method on this instance
    try:
        yield
    finally:
        del modules._maybe_set_engine_callback


def tracked_step(plan, optimizer, loss_fn, input_ids, layout: StateSharding) -> dict[str, float]:
    """One training step of `plan`'s model under torch's memory tracker (FSDPMemTracker for
    FSDP2, MemTracker otherwise), after a first step that creates the optimizer state: the
    bytes this rank held at the step's peak, by column of `Estimate`, and `peak`. Real or
    fake tensors alike (`measure`; benchmarks/estimate.py runs it on real ones)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    def step(tracker: MemTracker | None = None) -> None:
        with plan.autocast(), _gradients_in_forward(tracker):
            loss, _ = loss_fn(plan.model, input_ids, input_ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer state exists from here on
    if isinstance(plan.model, FSDPModule):
        tracker = FSDPMemTracker(plan.model, optimizer)
    else:
        tracker = MemTracker()  # ZeRO-1's state lives in its local optimizer
        tracker.track_external(plan.model, getattr(optimizer, "optim", optimizer))
    with tracker:
        step(tracker)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    out = dict.fromkeys(("parameters", "gradients", "optimizer", "gathered", "activations"), 0.0)
    for kind, value in peak.items():
        name = getattr(kind, "value", kind)
        if name != "Total":
            out[_COLUMNS.get(name, "activations")] += value  # the rest: activations, temps
    out["peak"] = float(peak["Total"])
    if layout.parameter_shards == 1 and plan.runtime.world_size == 1:
        # a replicated layout run as the plain model (zero1: each rank keeps 1/N of the state)
        out["peak"] -= out["optimizer"] * (1 - 1 / layout.optimizer_shards)
        out["optimizer"] /= layout.optimizer_shards
    return out

"""Per-rank memory of params + grads + optimizer state: world size 1 vs 2, per strategy.

Two measures per rank, over one AdamW step of llm/small's decoder (52M
parameters) on a tiny batch (so activations are negligible):
- state: bytes of this rank's parameters, gradients and optimizer state after
  the step (exact accounting of the tensors it holds);
- fwd/bwd peak: the peak of live tensor bytes during forward and backward,
  from torch's own trackers (FSDPMemTracker for FSDP2, MemTracker otherwise);
  it includes transient buffers: all-gathered parameters (zero2 keeps them
  from forward through backward), DDP's buckets.
Process RSS is not used: the CPU allocator keeps freed memory, so RSS shows
the high-water mark of the allocator, not of the training state.

    python benchmarks/memory.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import build_small, launch, local_bytes, table, write_result  # noqa: E402

STRATEGIES = ("fsdp", "zero2", "zero1", "ddp")
MIB = 2**20


def worker(strategy: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    runtime, model, optimizer = build_small(strategy)
    if isinstance(model, FSDPModule):
        tracker = FSDPMemTracker(model, optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    x = torch.randint(0, 259, (1, 32))
    with tracker:
        model(x).float().mean().backward()
    optimizer.step()
    peak = tracker.get_tracker_snapshot("peak")[runtime.device]["Total"]
    params = list(model.parameters())
    state = sum(local_bytes(p) + local_bytes(p.grad) for p in params)
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local one
    for per_param in inner.state.values():
        state += sum(local_bytes(v) for v in per_param.values() if torch.is_tensor(v))
    values = torch.tensor([state, peak], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)  # the worst rank
    write_result({"state": values[0].item(), "peak": values[1].item()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    single = launch(Path(__file__), 1, "--worker", "fsdp")  # world size 1: the plain model
    rows = []
    for strategy in STRATEGIES:
        two = launch(Path(__file__), 2, "--worker", strategy)
        rows.append([
            strategy,
            f"{single['state'] / MIB:.0f}", f"{two['state'] / MIB:.0f}",
            f"{two['state'] / single['state']:.2f}",
            f"{single['peak'] / MIB:.0f}", f"{two['peak'] / MIB:.0f}",
            f"{two['peak'] / single['peak']:.2f}",
        ])  # fmt: skip
    print("Per-rank memory, llm/small decoder (52M params, AdamW), world size 2 vs 1 (MiB)")
    print(
        table(
            rows,
            [
                "strategy",
                "state ws1",
                "state ws2",
                "ratio",
                "fwd/bwd peak ws1",
                "fwd/bwd peak ws2",
                "ratio",
            ],
        )
    )


if __name__ == "__main__":
    main()

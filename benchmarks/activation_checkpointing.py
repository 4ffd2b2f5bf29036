"""Activation checkpointing: activation memory saved vs time added, as ratios.

llm/small's decoder (52M params, 10 blocks), one process, batch 4 x 512
tokens. For each mode: the activation bytes autograd holds at the peak of
forward + backward (torch's MemTracker, 'Activation' category) and the median
time of a training step (forward, backward, AdamW step), relative to `none`.

    python benchmarks/activation_checkpointing.py [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import table  # noqa: E402

MODES = [("none", 1), ("selective", 2), ("full", 1)]
MIB = 2**20


def measure(mode: str, every_n: int, steps: int) -> tuple[float, float]:
    import torch
    from omegaconf import OmegaConf
    from torch.distributed._tools.mem_tracker import MemTracker

    from freetx.distributed import DistributedConfig, build_groups, init_distributed, parallelize
    from freetx.models.transformer import decoder

    runtime = init_distributed("cpu")
    cfg = DistributedConfig(activation_checkpointing=mode, ac_every_n_blocks=every_n)
    with torch.device("meta"):
        model = decoder("small", max_seq_len=512)
    model = parallelize(
        model, build_groups(runtime, OmegaConf.structured(cfg)), OmegaConf.structured(cfg), seed=0
    ).model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 259, (4, 512))

    def step():
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm up, create optimizer state
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
    optimizer.zero_grad(set_to_none=True)
    snapshot = tracker.get_tracker_snapshot("peak")[runtime.device]
    activations = next(v for k, v in snapshot.items() if "ACT" in str(k))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return activations, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    results = {f"{m} (every {n})" if m == "selective" else m: measure(m, n, args.steps)
               for m, n in MODES}  # fmt: skip
    base_memory, base_time = results["none"]
    rows = [
        [name, f"{mem / MIB:.0f}", f"{mem / base_memory:.2f}", f"{t:.2f}", f"{t / base_time:.2f}"]
        for name, (mem, t) in results.items()
    ]
    print("Activation checkpointing, llm/small decoder, batch 4 x 512, 1 CPU process")
    print(table(rows, ["mode", "activations MiB", "ratio", "s/step", "ratio"]))


if __name__ == "__main__":
    main()

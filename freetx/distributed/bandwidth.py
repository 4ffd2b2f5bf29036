"""Timed collectives for `freetx doctor`: all-reduce and all-gather bus bandwidth across
the launched processes, as nccl-tests defines it.

`freetx doctor` launches this module on N processes with freetx's launcher (`python -m
freetx.distributed.bandwidth RESULT.json MIB ITERS DEVICE TIMEOUT_S`); rank 0 writes the
figures to RESULT.json. A collective that does not complete within TIMEOUT_S fails the
ranks (the process group's timeout), so a broken network ends the check, not the user's
patience.

Bandwidths (nccl-tests' PERFORMANCE.md): algbw = S / t, where S is the bytes of the
operation's result (the all-reduced buffer; the gathered buffer, n x one rank's part);
busbw corrects for what the ranks must move: x 2(n-1)/n for all-reduce, x (n-1)/n for
all-gather. busbw is comparable with the hardware's link bandwidth at any n.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

from freetx.distributed.groups import ParallelGroups
from freetx.distributed.runtime import destroy_distributed, init_distributed
from freetx.errors import first_line

WARMUP_ITERATIONS = 2


@dataclass(frozen=True)
class Bandwidth:
    """One collective's mean time and bandwidths (GB/s, 1e9 bytes) at `ranks` processes."""

    collective: str
    ranks: int
    bytes: int  # S: the result's size
    seconds: float  # mean over the timed iterations
    algbw_gbs: float
    busbw_gbs: float


def bus_factor(collective: str, ranks: int) -> float:
    """busbw / algbw for a collective over `ranks` processes (nccl-tests)."""
    if collective == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if collective == "all_gather":
        return (ranks - 1) / ranks
    raise ValueError(f"no bus factor for {collective!r}")


def bandwidth(collective: str, ranks: int, result_bytes: int, seconds: float) -> Bandwidth:
    algbw = result_bytes / seconds / 1e9
    return Bandwidth(
        collective, ranks, result_bytes, seconds, algbw, algbw * bus_factor(collective, ranks)
    )


def _timed(run, device: torch.device, iterations: int) -> float:
    """Mean seconds of `run()` over `iterations`, after warm-up."""
    for _ in range(WARMUP_ITERATIONS):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iterations


def measure(groups: ParallelGroups, mebibytes: float, iterations: int) -> list[Bandwidth]:
    """All-reduce of a `mebibytes` float32 buffer, and all-gather into one of that size,
    over every rank; the slowest rank's time (the collective ends when it does)."""
    device = groups.runtime.device
    ranks = groups.size("world")
    elements = max(ranks, int(mebibytes * 2**20) // 4 // ranks * ranks)
    buffer = torch.ones(elements, dtype=torch.float32, device=device)
    part = buffer[: elements // ranks].clone()
    groups.barrier()
    times = {
        "all_reduce": _timed(lambda: groups.all_reduce(buffer, over="world"), device, iterations),
        "all_gather": _timed(lambda: groups.all_gather(part, over="world"), device, iterations),
    }
    slowest = torch.tensor(list(times.values()), dtype=torch.float64, device=device)
    groups.all_reduce(slowest, op="max", over="world")
    return [
        bandwidth(name, ranks, elements * 4, seconds)
        for name, seconds in zip(times, slowest.tolist())
    ]


def main(argv: list[str]) -> int:
    result_path, mebibytes, iterations, device, timeout_s = argv
    rank = os.environ.get("RANK", "0")
    try:
        runtime = init_distributed(device, timeout_s=float(timeout_s))
        record = {"device": runtime.device_type, "backend": runtime.backend}
        results = measure(ParallelGroups(runtime), float(mebibytes), int(iterations))
    except Exception as e:  # no network, a broken or timed-out collective: one line each
        print(f"freetx doctor: rank {rank}: {type(e).__name__}: {first_line(e)}", flush=True)
        return 1
    finally:
        destroy_distributed()
    if runtime.is_rank_zero:
        record["results"] = [asdict(r) for r in results]
        with open(result_path, "w", encoding="utf-8") as f:
            json.dump(record, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

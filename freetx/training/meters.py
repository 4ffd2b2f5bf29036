"""Meters: throughput, MFU and memory, the numbers logged beside the loss.

MFU = (training FLOPs per token x tokens per second per device) / peak FLOPs.
FLOPs per token come from the model's shape (`model.flops_per_token`); peak
FLOPs from the table of known GPUs below (dense bf16 tensor-core numbers from
the vendors' data sheets), or from `peak_flops` in the config for CPUs and
anything else; `measure_matmul_flops` measures a CPU's matmul peak.
"""

from __future__ import annotations

import resource
import sys
import time

import torch

from freetx.distributed import ParallelGroups

# Dense (no sparsity) bf16 peak, FLOP/s, matched by substring of the device name.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 125e12,
    "A10": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,  # fp16; no bf16 on Volta
    "MI300X": 1307e12,
    "MI250X": 383e12,
}


def peak_flops(device: torch.device, configured: float | None = None) -> float | None:
    """Peak FLOP/s of one device: the config's value, else the GPU table, else None."""
    if configured:
        return float(configured)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_BF16_FLOPS.items():
            if key in name:
                return value
    return None


def measure_matmul_flops(size: int = 1024, seconds: float = 1.0, dtype=torch.float32) -> float:
    """Measured FLOP/s of square matmuls on this CPU (a practical peak for MFU)."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b  # warm up
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * size**3 * count / (time.perf_counter() - start)


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory of this rank in GiB: CUDA allocated/reserved, or max RSS on CPU."""
    if device.type == "cuda":
        return {
            "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "memory/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024
    return {"memory/max_rss_gib": rss_bytes / 2**30}


class ThroughputMeter:
    """Tokens/s (global and per device), step time and MFU over the last logged steps."""

    def __init__(self, flops_per_token: float, world_size: int, peak: float | None) -> None:
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.peak = peak
        self.reset()

    def reset(self) -> None:
        self._tokens = 0
        self._steps = 0
        self._start = time.perf_counter()

    def update(self, global_tokens: int) -> None:
        self._tokens += global_tokens
        self._steps += 1

    def read(self) -> dict[str, float]:
        """Metrics since the last read; then start a new window."""
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        tokens_per_s = self._tokens / elapsed
        per_device = tokens_per_s / self.world_size
        metrics = {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": per_device,
            "step_time_s": elapsed / max(self._steps, 1),
        }
        if self.peak:
            metrics["mfu_pct"] = 100.0 * self.flops_per_token * per_device / self.peak
        self.reset()
        return metrics


def train_step_metrics(
    groups: ParallelGroups,
    sums: dict[str, torch.Tensor],
    num_tokens,
    grad_norm: float,
    lr_scheduler,
    meter,
) -> dict[str, float]:
    """A logged step's metrics: per-token means of the loss sums over the data-parallel
    ranks and the peak memory of the fullest rank (one collective: every rank calls it),
    lr, grad norm, throughput."""
    totals, memory = groups.sum_and_max(
        {k: v.detach() for k, v in sums.items()}, memory_stats(groups.runtime.device)
    )
    units = max(float(num_tokens), 1.0)  # a window without loss tokens logs 0, not NaN
    metrics = {name: value / units for name, value in totals.items()}
    metrics["lr"] = float(lr_scheduler.get_last_lr()[0])  # torchao keeps lr as a tensor
    metrics["grad_norm"] = grad_norm
    metrics.update(meter.read())
    metrics.update(memory)
    return metrics

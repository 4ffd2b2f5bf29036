"""Meters: throughput, MFU and memory, the numbers logged beside the loss.

MFU = (training FLOPs per token x tokens per second per device) / peak FLOPs.
FLOPs per token come from the model's shape (`freetx.models.training_flops_per_token`:
`model.flops_per_token`, a frozen weight's at 4 instead of 6); peak
FLOPs from the table of known GPUs below (dense bf16 tensor-core numbers from
the vendors' data sheets), or from `peak_flops` in the config for CPUs and
anything else; `measure_matmul_flops` measures a CPU's matmul peak.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from freetx.data import GlobalBatchSampler, TokenBatch
from freetx.data.batch import sample_positions
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
    """Throughput, step time and MFU over the steps since the last logged one, of the
    training steps only: time spent `apart` (an evaluation, a save) is left out of them.

    A step counts its positions (batch_size x seq_len: what the model computes), and,
    where the recipe says, its real tokens (positions that are not padding; this rank's,
    summed over the data-parallel ranks when logged, in the step metrics' collective) and
    its loss tokens (global). Logged: `tokens_per_s` (real tokens), `loss_tokens_per_s`,
    `padding_fraction` (of the positions), `tokens_per_s_per_device`, and MFU from the
    real tokens: padding is not counted as work.
    """

    REAL = "meter/real_tokens"  # this rank's real tokens, in the logged step's sums

    def __init__(self, flops_per_token: float, world_size: int, peak: float | None) -> None:
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.peak = peak
        self.reset()

    def reset(self) -> None:
        self._positions = 0
        self._real: float | None = 0.0  # None: a step did not say (every position is real)
        self._loss_tokens: float | None = 0.0
        self._steps = 0
        self._start = time.perf_counter()
        self._apart: dict[str, float] = {}  # seconds spent outside the steps, by name

    @contextmanager
    def apart(self, name: str) -> Iterator[None]:
        """Time spent inside is not the steps' (an evaluation, a save): left out of step
        time, tokens/s and MFU, and logged as `time/<name>` with the next read."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._apart[name] = self._apart.get(name, 0.0) + time.perf_counter() - start

    def update(
        self, positions: int, real_tokens: float | None = None, loss_tokens: float | None = None
    ) -> None:
        """One step: `positions` over all ranks; `real_tokens` this rank's (None: every
        position), `loss_tokens` over all ranks (None: not logged)."""
        self._positions += positions
        self._steps += 1
        self._real = None if real_tokens is None or self._real is None else self._real + real_tokens
        self._loss_tokens = (
            None
            if loss_tokens is None or self._loss_tokens is None
            else self._loss_tokens + float(loss_tokens)
        )

    def local_sums(self) -> dict[str, torch.Tensor]:
        """What a logged step sums over the data-parallel ranks for `read`."""
        return {} if self._real is None else {self.REAL: torch.tensor(float(self._real))}

    def read(self, totals: dict[str, float] | None = None) -> dict[str, float]:
        """Metrics since the last read (`totals`: `local_sums` summed over the
        data-parallel ranks); then start a new window. The time spent apart since the
        last read is logged as `time/<name>` beside them."""
        apart = sum(self._apart.values())
        elapsed = max(time.perf_counter() - self._start - apart, 1e-9)
        real = (totals or {}).get(self.REAL, self._positions)
        tokens_per_s = real / elapsed
        per_device = tokens_per_s / self.world_size
        metrics = {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": per_device,
            "padding_fraction": 1.0 - real / max(self._positions, 1),
            "step_time_s": elapsed / max(self._steps, 1),
            **{f"time/{name}": seconds for name, seconds in self._apart.items()},
        }
        if self._loss_tokens is not None:
            metrics["loss_tokens_per_s"] = self._loss_tokens / elapsed
        if self.peak:
            metrics["mfu_pct"] = 100.0 * self.flops_per_token * per_device / self.peak
        self.reset()
        return metrics


def real_tokens(batches: list[TokenBatch], groups: ParallelGroups) -> float:
    """This rank's share of the positions of its token batches that are not padding
    (`real_tokens` per sample where the data says, as packed and padded samples do; else
    every position): the cp ranks that split the batches share them out."""
    return sum(batch.real_positions() for batch in batches) / groups.size("cp")


def first_batches_padding(loader, steps: int = 4) -> str | None:
    """The share of padding among the positions of this rank's first `steps` optimizer
    steps (the loader's sampler says which samples; read from the dataset, the loader
    untouched), for the banner; None where samples do not say (`real_tokens`)."""
    sampler, dataset = loader.batch_sampler, loader.dataset
    if not isinstance(sampler, GlobalBatchSampler):
        return None
    positions = real = 0
    for step in range(steps):
        for micro in range(sampler.accumulation):
            for index in sampler.indices(step, micro):
                length, not_padding = sample_positions(dataset[index])
                if not_padding is None:
                    return None
                positions += length
                real += not_padding
    if not positions:
        return None
    return f"{100 * (1 - real / positions):.1f}% of the first {steps} steps' positions"


def per_source_means(metrics: dict[str, float], prefix: str = "") -> dict[str, float]:
    """A mixture's per-source sums made means: `loss/<name>` over `loss_tokens/<name>`
    (both divided by the same total before, which the ratio cancels;
    `freetx.data.SourcesOf`). A source without loss tokens in the window
    is left out."""
    means = {}
    for key, value in metrics.items():
        if key.startswith(prefix + "loss_tokens/"):
            continue
        name = key[len(prefix + "loss/") :] if key.startswith(prefix + "loss/") else None
        if name is None:
            means[key] = value
            continue
        tokens = metrics[f"{prefix}loss_tokens/{name}"]
        if tokens > 0:
            means[key] = value / tokens
    return means


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
        {**{k: v.detach() for k, v in sums.items()}, **meter.local_sums()},
        memory_stats(groups.runtime.device),
        over="dp_cp",  # the ranks that hold different tokens (tp ranks hold the same)
    )
    counted = {k: totals.pop(k) for k in meter.local_sums()}
    units = max(float(num_tokens), 1.0)  # a window without loss tokens logs 0, not NaN
    metrics = per_source_means({name: value / units for name, value in totals.items()})
    metrics["lr"] = float(lr_scheduler.get_last_lr()[0])  # torchao keeps lr as a tensor
    metrics["grad_norm"] = grad_norm
    metrics.update(meter.read(counted))
    metrics.update(memory)
    return metrics

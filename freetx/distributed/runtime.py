"""The process group and the device.

`init_distributed` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK);
without torchrun it makes a world of size 1 in this process, so every strategy
(FSDP2, DDP, ZeRO) runs the same code on one process as on many. The backend is
nccl on CUDA and gloo on CPU, chosen by the device, never hard-coded.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from freetx.errors import ConfigError

DEVICE_CHOICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DistributedRuntime:
    """Where this process stands: its rank, the world, its device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def backend(self) -> str:
        return dist.get_backend() if dist.is_initialized() else "none"


def check_device(device: str, processes_per_node: int) -> None:
    """`device: cuda` needs a usable CUDA device, one per process of this node (a rank's
    check, and `freetx run`'s before it launches any)."""
    if device != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            "device: cuda was asked for, but this machine has no usable CUDA device.",
            fix="Use device=auto (CPU here) or device=cpu.",
        )
    count = torch.cuda.device_count()
    if processes_per_node > count:
        raise ConfigError(
            f"{processes_per_node} processes per node with device: cuda need a GPU each, and "
            f"this node has {count}.",
            fix=f"Launch at most {count} processes per node (--nproc-per-node {count}).",
        )


def select_device(device: str, local_rank: int = 0) -> torch.device:
    """`auto` -> cuda:LOCAL_RANK when CUDA is present, else cpu."""
    if device not in DEVICE_CHOICES:
        raise ConfigError(f"device '{device}' is not one of {', '.join(DEVICE_CHOICES)}.")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        check_device(device, local_rank + 1)
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `gpu[03-05,07],cpu1` -> `gpu03`."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    if "[" not in head:
        return head.strip()
    prefix, _, ranges = head.partition("[")
    first = ranges.split("]")[0].split(",")[0].split("-")[0]
    return f"{prefix}{first}"


def slurm_environment(env: dict[str, str]) -> dict[str, str]:
    """torchrun's variables from SLURM's, for `srun freetx run ...` with one task per
    process and no torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR (the first node),
    MASTER_PORT (from the job id, unless set). Empty outside such a step."""
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return {}
    found = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0],
    }
    if int(found["WORLD_SIZE"]) > 1:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "localhost")
        found["MASTER_ADDR"] = env.get("MASTER_ADDR", first_host(nodelist))
        found["MASTER_PORT"] = env.get(
            "MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
        )
    return found


def attempt_store(world_size: int, timeout: timedelta) -> dist.Store:
    """torchrun's store, with this attempt's keys kept apart from earlier attempts'.

    torchrun keeps one store across the restarts of a group (`--max-restarts`) and its
    workers' keys carry no attempt, so a restarted rank could read the address a dead
    rank published and fail to connect ("Connection refused" in gloo's connectFullMesh).
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"freetx/attempt_{attempt}/", store)


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> DistributedRuntime:
    """Join (or create) the process group and pick this rank's device.

    Ranks come from torchrun's environment, or from SLURM's when `srun` started one
    task per process without torchrun. `timeout_s` bounds every collective: a rank
    that does not arrive ends the job after it (`distributed.collective_timeout_s`).
    """
    os.environ.update(slurm_environment(dict(os.environ)))
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch_device = select_device(device, local_rank)
    if torch_device.type == "cpu":
        # Denormal floats (below 1.2e-38, common in late gradients) run ~10x slower through
        # x86 vector units; flushed to zero as on GPUs: llm/tiny_llama_bench steps ~6% faster
        torch.set_flush_denormal(True)
    if not dist.is_initialized():
        # CUDA: nccl for tensors, gloo beside it for CPU-side collectives (DCP metadata).
        backend = "cuda:nccl,cpu:gloo" if torch_device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store = attempt_store(world_size, timeout)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timeout
            )
        elif "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:  # not launched by torchrun: a private world of one
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    return DistributedRuntime(rank, local_rank, world_size, torch_device)


def destroy_distributed() -> None:
    """Leave the process group (safe to call twice, or when none was made)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def fake_world(world_size: int):
    """A process group of `world_size` ranks in which this process is rank 0 and every
    collective does nothing (torch's "fake" backend): for measuring one rank's memory
    without the others (`freetx estimate --measure`)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()

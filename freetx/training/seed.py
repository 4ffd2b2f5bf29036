"""Seeding, and the RNG states that checkpoints save and restore per rank."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

# cuBLAS's fixed workspaces (read when its first handle is made): what torch's
# deterministic algorithms need on CUDA >= 10.2
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def deterministic_env(deterministic: bool) -> dict[str, str]:
    """The environment a run's processes need for `deterministic: true` (set by `freetx
    run` before it launches the ranks, so that it is there before CUDA starts); a value the
    user set wins."""
    if not deterministic:
        return {}
    return {k: os.environ.get(k, v) for k, v in DETERMINISTIC_ENV.items()}


def seed_everything(seed: int, rank: int = 0, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (CPU and CUDA) for this rank.

    Ranks get different streams (seed + rank), so dropout masks are independent
    across ranks. Parameter init does not use these streams (it has its own
    per-parameter generators), so initial weights do not depend on the rank.

    `deterministic` (the config's `deterministic: true`): torch's deterministic
    algorithms (an op without one raises, naming it), cuDNN's deterministic kernels and no
    benchmarking, cuBLAS's fixed workspace. Slower on a GPU; off, only the seeds are set
    (and the flags are put back to torch's defaults).
    """
    rank_seed = seed + rank
    random.seed(rank_seed)
    np.random.seed(rank_seed % 2**32)
    torch.manual_seed(rank_seed)
    if deterministic:
        os.environ.update(deterministic_env(True))  # before cuBLAS's first handle
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False


def rng_state() -> dict[str, Any]:
    """This rank's RNG states: python, numpy, torch CPU, and CUDA where present.

    Only tensors, numbers, strings and lists, so a checkpoint can hold it
    without pickled objects (numpy's key array becomes a tensor).
    """
    kind, keys, position, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

"""Seeding, and the RNG states that checkpoints save and restore per rank."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int, rank: int = 0) -> None:
    """Seed python, numpy and torch (CPU and CUDA) for this rank.

    Ranks get different streams (seed + rank), so dropout masks are independent
    across ranks. Parameter init does not use these streams (it has its own
    per-parameter generators), so initial weights do not depend on the rank.
    """
    rank_seed = seed + rank
    random.seed(rank_seed)
    np.random.seed(rank_seed % 2**32)
    torch.manual_seed(rank_seed)


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

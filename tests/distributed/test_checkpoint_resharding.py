"""A checkpoint saved at one world size / strategy loads at another with the same outputs."""

from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_checks

SCRIPT = Path(__file__).with_name("checkpoint_checks.py")

# (saved by: world size, strategy) -> loaded by (world size, strategy)
CASES = [
    ((2, "fsdp"), (1, "fsdp")),  # 2 -> 1 process
    ((1, "fsdp"), (2, "fsdp")),  # 1 -> 2 processes
    ((2, "fsdp"), (2, "ddp")),  # FSDP2 -> DDP
    ((2, "fsdp"), (2, "hsdp")),
    ((2, "zero1"), (1, "ddp")),  # ZeRO-1 (optimizer sharded by DDP rank) -> 1 process
    ((2, "zero1"), (2, "fsdp")),
    ((2, "ddp"), (2, "zero1")),
    ((2, "zero2"), (2, "zero1")),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Four launches: saves at ws2, loads (and a save) at ws1, loads at ws2."""
    root = tmp_path_factory.mktemp("resharding")

    def ckpt(world, strategy):
        return root / f"ckpt_{world}_{strategy}"

    def tasks(action, pairs):
        return [f"{action}:{s}:{ckpt(*saver)}" for saver, s in pairs]

    saves2 = sorted({saver for saver, _ in CASES if saver[0] == 2})
    saved2 = run_checks(SCRIPT, root / "a", 2, *[f"save:{s}:{ckpt(2, s)}" for _, s in saves2])
    ws1 = tasks("load", [(saver, loader[1]) for saver, loader in CASES if loader[0] == 1])
    ws1 += [f"save:fsdp:{ckpt(1, 'fsdp')}"]  # loaded at world size 2 below
    at1 = run_checks(SCRIPT, root / "b", 1, *ws1)
    ws2 = tasks("load", [(saver, loader[1]) for saver, loader in CASES if loader[0] == 2])
    at2 = run_checks(SCRIPT, root / "c", 2, *ws2)
    return {"saves2": saved2, "ws1": at1, "load2": at2, "ckpt": ckpt}


def close(a, b) -> bool:
    return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "saver,loader", CASES, ids=[f"{a[1]}{a[0]}-{b[1]}{b[0]}" for a, b in CASES]
)
def test_checkpoint_loads_at_another_world_size_and_strategy(results, saver, loader):
    path = results["ckpt"](*saver)
    saved_by = results["saves2"] if saver[0] == 2 else results["ws1"]
    reference = saved_by[0][f"save:{saver[1]}:{path}"]
    loaded_by = results["ws1"] if loader[0] == 1 else results["load2"]
    for rank in loaded_by:
        loaded = rank[f"load:{loader[1]}:{path}"]
        assert loaded["step"] == 2 and loaded["world_size"] == loader[0]
        assert close(loaded["outputs"], reference["outputs"])
        assert close(loaded["after_step"], reference["after_step"])

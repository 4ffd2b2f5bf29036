"""Run a check script on N gloo processes via torchrun and collect its JSON results.

A check script writes `{name: result}` to `$FREETX_TEST_OUT/rank<R>.json`; one
launch runs many checks, so the 2-process suite pays torchrun's start-up once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_checks(
    script: Path, out_dir: Path, nproc: int = 2, *args: str, timeout: float = 600
) -> list[dict]:
    repo = str(Path(__file__).resolve().parents[2])  # check scripts import tests.*
    pythonpath = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    # PYTHONFAULTHANDLER: a rank that dies of a signal (SIGSEGV: seen once in a 4-process
    # tp run on 2026-11-27, not reproduced in 6 more) prints its Python stack
    env = {**os.environ, "FREETX_TEST_OUT": str(out_dir), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": pythonpath, "PYTHONFAULTHANDLER": "1"}  # fmt: skip
    for _attempt in range(2):
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={nproc}", str(script), *args],
            env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        # A rank aborted by C++ (std::terminate: seen twice in ~40 launches on 2026-11-23,
        # at start-up, before any check ran) gets one more launch; any other failure
        # fails the test at once.
        if "terminate called without an active exception" not in result.stderr:
            break
    if result.returncode != 0:
        raise AssertionError(f"{script.name} failed:\n{result.stdout}\n{result.stderr[-6000:]}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def write_results(results: dict) -> None:
    out = Path(os.environ["FREETX_TEST_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    # Leave together: a rank exiting while gloo still runs threads for another aborts.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def folder_plan(folder: str, runtime, strategy: str = "fsdp"):
    """The parallel plan of an HF folder's model (`hf_model`, built on the meta device) under
    `strategy`, its weights not read yet."""
    import torch
    from omegaconf import OmegaConf

    from freetx.distributed import DistributedConfig, build_groups, parallelize
    from freetx.models import hf_model

    with torch.device("meta"):
        model = hf_model(folder)
    cfg = OmegaConf.structured(DistributedConfig(strategy=strategy))
    return parallelize(model, build_groups(runtime, cfg), cfg, seed=0)

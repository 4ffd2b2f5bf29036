"""Helpers the benchmarks share: launching N processes, loading a recipe, printing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def launch(script: Path, nproc: int, *args: str, timeout: float = 1200) -> dict:
    """Run `script` on nproc gloo processes (torchrun); return what rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "BENCH_OUT": str(out), "PYTHONPATH": str(REPO)}
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", str(script), *args]  # fmt: skip
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{script.name} failed:\n{result.stderr[-4000:]}")
        return json.loads(out.read_text())


def write_result(result: dict) -> None:
    """Rank 0 writes the result for `launch` to read."""
    if int(os.environ.get("RANK", "0")) == 0 and os.environ.get("BENCH_OUT"):
        Path(os.environ["BENCH_OUT"]).write_text(json.dumps(result))


def load_recipe_module(name: str):
    """The built-in recipe's module (its class and schema), loaded by path."""
    from freetx.cli.common import load_recipe

    target = load_recipe(name)
    return sys.modules[f"freetx_recipe_{target.path.stem}"], target.schema


def build_small(strategy: str = "fsdp"):
    """llm/small's decoder (52M params) parallelized on this process group, with AdamW."""
    import torch
    from omegaconf import OmegaConf

    from freetx.distributed import DistributedConfig, build_groups, init_distributed, parallelize
    from freetx.models.transformer import decoder

    runtime = init_distributed("cpu")
    with torch.device("meta"):
        model = decoder("small", max_seq_len=64)
    plan = parallelize(
        model,
        build_groups(runtime, DistributedConfig(strategy=strategy)),
        OmegaConf.structured(DistributedConfig(strategy=strategy)),
        0,
    )
    optimizer = plan.build_optimizer(
        OmegaConf.create({"_component_": "torch.optim.AdamW", "lr": 1e-4})
    )
    return runtime, plan.model, optimizer


def freetx(*args: str, env=None) -> subprocess.CompletedProcess:
    """`python -m freetx ARGS` from the repository; its output in the error if it fails."""
    cmd = [sys.executable, "-m", "freetx", *args]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(args[:3])} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    return result


def measured_run(config: str, overrides: list[str], steps: int, nproc: int, out: Path) -> dict:
    """One `freetx run` of `config` on nproc processes (one thread each unless
    OMP_NUM_THREADS says): the fullest rank's max RSS (bytes), the median step time and
    tokens per second over steps 3..N, from its metrics.jsonl."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    freetx("run", "--nproc-per-node", str(nproc), "full_finetune_fsdp2", "--config", config,
           f"output_dir={out}", f"max_steps={steps}", *overrides, env=env)  # fmt: skip
    train = step_records(out / "metrics.jsonl")
    median = medians(train, ["step_time_s", "tokens_per_s"], after=2)
    return {
        "rss": max(r["memory/max_rss_gib"] for r in train) * 2**30,
        "step_s": median["step_time_s"],
        "tokens_per_s": median["tokens_per_s"],
    }


def step_records(metrics: Path) -> list[dict]:
    """The training steps' records of a run's metrics.jsonl (those with a step time)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in records if "step_time_s" in r]


def medians(records: list[dict], keys: list[str], after: int) -> dict:
    """Each key's median over the records of the steps after `after` (over the last record
    where there are none), the keys no record has left out."""
    import statistics

    later = [r for r in records if r["step"] > after] or records[-1:]
    return {
        key: statistics.median(r[key] for r in later if key in r)
        for key in keys
        if any(key in r for r in later)
    }


def table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def local_bytes(tensor) -> int:
    """Bytes this rank holds of a tensor: a DTensor's local shard, an NF4 tensor's
    quantized data and scales."""
    if tensor is None:
        return 0
    local = getattr(tensor, "_local_tensor", tensor)
    if type(local).__name__ == "NF4Tensor":
        names, _ = local.__tensor_flatten__()
        return sum(getattr(local, n).numel() * getattr(local, n).element_size() for n in names)
    return local.numel() * local.element_size()

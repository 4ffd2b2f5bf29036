"""Checkpoint speed and memory, measured side by side.

1. Save throughput: a DCP save of model + AdamW state (llm/small's decoder,
   52M params) vs a raw sequential write of the same number of bytes to the
   same disk; both fsync'd. Ratio = DCP GB/s / raw GB/s (target >= 0.7).
2. Async save: seconds the training loop is blocked by saves (inside save()
   and the wait for the previous one) with async_save vs a synchronous save,
   over the same steps. Ratio = async / sync (target <= 0.2).
3. Convert DCP -> safetensors: the converting process's peak RSS growth vs the
   model's bytes (target <= 1.3); DCP -> torch.save (model only) beside it.

    python benchmarks/checkpoint.py [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import build_small, table  # noqa: E402

GB = 1e9


def train_step(model, optimizer) -> None:
    import torch

    x = torch.randint(0, 259, (4, 64))
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def raw_write(path: Path, data: bytes, chunk: int = 64 * 2**20) -> float:
    """Seconds to write `data` sequentially in 64 MiB chunks and fsync it.

    The data is random (tensors are not compressible); a repeated block would
    let the virtual disk deduplicate it and look 5x faster than it is.
    """
    os.sync()  # no dirty pages left over from the previous write
    start = time.perf_counter()
    with open(path, "wb") as f:
        view = memoryview(data)
        for offset in range(0, len(data), chunk):
            f.write(view[offset : offset + chunk])
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def checkpointer_for(output_dir: Path, rank: int, max_steps: int, async_save: bool = False):
    """A Checkpointer for a fresh folder, as a recipe makes it from its run config."""
    from omegaconf import OmegaConf

    from freetx.checkpoint import CheckpointConfig, Checkpointer

    run = {"output_dir": str(output_dir), "resume": "never", "max_steps": max_steps,
           "checkpoint": OmegaConf.structured(CheckpointConfig(async_save=async_save))}  # fmt: skip
    return Checkpointer(OmegaConf.create(run), rank)


def save_throughput(workdir: Path, rounds: int = 3) -> dict:
    """freetx's checkpointer (DCP, sync) vs raw writes, alternating; medians."""
    import statistics

    from freetx.checkpoint import ModelState, OptimizerState

    runtime, model, optimizer = build_small()
    train_step(model, optimizer)
    state = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}
    checkpointer = checkpointer_for(workdir / "throughput", runtime.rank, rounds)
    dcp_times, raw_times, data = [], [], b""
    for i in range(rounds):
        os.sync()
        start = time.perf_counter()
        checkpointer.save(i + 1, state, {})
        dcp_times.append(time.perf_counter() - start)
        saved = workdir / "throughput" / "checkpoints" / f"step_{i + 1:06d}"
        nbytes = sum(f.stat().st_size for f in saved.iterdir())
        if len(data) != nbytes:
            data = os.urandom(nbytes)
        raw_times.append(raw_write(workdir / "raw.bin", data))
        (workdir / "raw.bin").unlink()
    checkpointer.close()
    return {"bytes": nbytes, "dcp_s": statistics.median(dcp_times),
            "raw_s": statistics.median(raw_times)}  # fmt: skip


def async_blocking(workdir: Path, steps: int = 12, every: int = 4) -> dict:
    from freetx.checkpoint import ModelState, OptimizerState

    runtime, model, optimizer = build_small()
    train_step(model, optimizer)
    result = {}
    for mode in ("sync", "async"):
        checkpointer = checkpointer_for(workdir / mode, runtime.rank, steps, mode == "async")
        state = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}
        blocked = 0.0
        start = time.perf_counter()
        for step in range(1, steps + 1):
            train_step(model, optimizer)
            if step % every == 0:
                t = time.perf_counter()
                checkpointer.save(step, state, {})  # async: waits for the previous save
                blocked += time.perf_counter() - t
        loop = time.perf_counter() - start
        t = time.perf_counter()
        checkpointer.close()  # the end of training waits for the last async write
        result[mode] = {
            "blocked_s": blocked,
            "loop_s": loop,
            "final_wait_s": time.perf_counter() - t,
        }
    return result


# VmHWM (the peak RSS of this process image), not ru_maxrss: Linux carries
# ru_maxrss over from the parent across exec, which hides a child's own peak.
CONVERT_PROBE = """
import json, sys, time
def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
from freetx.checkpoint import convert, open_tensors
source = open_tensors(sys.argv[1])
model_bytes = sum(source.infos[n].nbytes for n in source.infos if n.startswith("model."))
before = peak_rss()
start = time.perf_counter()
convert(sys.argv[1], sys.argv[2], model_only=True)
seconds = time.perf_counter() - start
print(json.dumps({"model_bytes": model_bytes, "growth": peak_rss() - before, "seconds": seconds}))
"""


def convert_memory(checkpoint: Path, workdir: Path) -> dict:
    out = {}
    for name, dst in (("safetensors", "m.safetensors"), ("torch", "m.pt")):
        probe = subprocess.run(
            [sys.executable, "-c", CONVERT_PROBE, str(checkpoint), str(workdir / dst)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        out[name] = json.loads(probe.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where to write (default: a temporary folder on /tmp's disk)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        workdir = Path(tmp)
        throughput = save_throughput(workdir)
        blocking = async_blocking(workdir)
        converted = convert_memory(workdir / "throughput" / "checkpoints" / "step_000001", workdir)

    dcp_rate = throughput["bytes"] / throughput["dcp_s"] / GB
    raw_rate = throughput["bytes"] / throughput["raw_s"] / GB
    print(f"Checkpoint save of llm/small's decoder + AdamW state ({throughput['bytes'] / GB:.2f} GB), "
          "1 process, median of 3, both fsync'd")  # fmt: skip
    print(table(
        [["DCP save", f"{throughput['dcp_s']:.2f}", f"{dcp_rate:.2f}", f"{dcp_rate / raw_rate:.2f}"],
         ["raw sequential write", f"{throughput['raw_s']:.2f}", f"{raw_rate:.2f}", "1.00"]],
        ["save", "seconds", "GB/s", "ratio"],
    ))  # fmt: skip
    sync, asyn = blocking["sync"], blocking["async"]
    print(
        "\nTraining loop blocked by saves (12 steps, a save every 4; 2 CPU cores shared with the writer)"
    )
    print(table(
        [["sync", f"{sync['blocked_s']:.2f}", f"{sync['loop_s']:.2f}", f"{sync['final_wait_s']:.2f}", "1.00"],
         ["async", f"{asyn['blocked_s']:.2f}", f"{asyn['loop_s']:.2f}", f"{asyn['final_wait_s']:.2f}",
          f"{asyn['blocked_s'] / sync['blocked_s']:.2f}"]],
        ["mode", "blocked s", "loop s", "end-of-run wait s", "blocked ratio"],
    ))  # fmt: skip
    print("\nConvert DCP -> file, model only: peak RSS growth of the converting process")
    rows = []
    for name, r in converted.items():
        rows.append([name, f"{r['model_bytes'] / 2**20:.0f}", f"{r['growth'] / 2**20:.0f}",
                     f"{r['growth'] / r['model_bytes']:.2f}", f"{r['seconds']:.2f}"])  # fmt: skip
    print(table(rows, ["to", "model MiB", "RSS growth MiB", "ratio", "seconds"]))


if __name__ == "__main__":
    main()

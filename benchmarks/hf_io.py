"""HF folders in and out at ~1B scale: memory per rank and time, measured side by side.

1. A Llama 3.2 1B-shaped model (1.24B parameters, random fp32 weights) is written as
   an HF folder of 1 GB shards with its index.
2. Load on 2 processes with FSDP (`checkpoint.initial_weights` does exactly this):
   build on the meta device, shard, read each rank's rows. Peak RSS growth per rank
   vs the model's bytes (target <= 0.6), and the load time vs one process reading
   the same files raw (both from the page cache: the folder was just written).
3. The loaded model is saved as a DCP checkpoint (as a run's save), then exported
   back to an HF folder (`freetx checkpoint convert ... --to hf`): the converting
   process's peak RSS growth vs the largest shard (target <= 1.2).

    python benchmarks/hf_io.py [--preset llama3_1b|small] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import launch, table  # noqa: E402

SHARD = "1GB"


def peak_rss() -> int:
    """VmHWM: this process image's peak resident memory (bytes)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def write_folder(preset: str, folder: Path) -> dict:
    """A random-weight HF folder of the preset's shape, written a tensor at a time."""
    import torch

    from freetx.checkpoint.convert import _write_hf
    from freetx.checkpoint.formats import TensorInfo, TensorSource
    from freetx.models.transformer import decoder

    with torch.device("meta"):
        model = decoder(preset)
    config = dict(model.config.__dict__)

    class RandomWeights(TensorSource):
        kind = "random"

        def __init__(self) -> None:
            super().__init__(folder)
            self.infos = {f"model.{n}": TensorInfo(tuple(p.shape), torch.float32)
                          for n, p in model.named_parameters()}  # fmt: skip
            self.meta = {"model_class": "freetx.models.transformer.Transformer",
                         "model_config": config}  # fmt: skip

        def get(self, name: str) -> torch.Tensor:
            return torch.randn(self.infos[name].shape) * 0.02

    source = RandomWeights()
    _write_hf(source, folder, lambda t: t, lambda info: info.dtype, SHARD, None)
    return {"model_bytes": sum(i.nbytes for i in source.infos.values()), "config": config}


def load_on_ranks(folder: str, dcp_dir: str) -> None:
    """Run by torchrun: load the folder under FSDP, record memory and time, save DCP."""
    import torch
    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf

    from benchmarks.common import write_result
    from freetx.checkpoint import ModelState, load_initial_weights
    from freetx.distributed import DistributedConfig, build_groups, init_distributed, parallelize
    from freetx.models.transformer import hf_decoder

    runtime = init_distributed("cpu")
    before = rss()
    start = time.perf_counter()
    with torch.device("meta"):
        model = hf_decoder(folder)
    cfg = OmegaConf.structured(DistributedConfig(strategy="fsdp"))
    plan = parallelize(model, build_groups(runtime, cfg), cfg, seed=0, init_weights=False)
    load_initial_weights(plan.model, folder)
    torch.distributed.barrier()
    seconds = time.perf_counter() - start
    growth = peak_rss() - before
    growths = [None] * runtime.world_size
    torch.distributed.all_gather_object(growths, growth)
    dcp.save({"model": ModelState(plan.model)}, checkpoint_id=dcp_dir)
    if runtime.rank == 0:
        meta = {"model_class": "freetx.models.transformer.Transformer",
                "model_config": dict(model.config.__dict__)}  # fmt: skip
        (Path(dcp_dir) / "meta.json").write_text(json.dumps(meta))
    write_result({"seconds": seconds, "growth_per_rank": growths})
    torch.distributed.barrier()  # leave together: gloo aborts a rank whose peer is gone
    torch.distributed.destroy_process_group()


def raw_read_seconds(folder: Path) -> float:
    start = time.perf_counter()
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            while f.read(64 * 2**20):
                pass
    return time.perf_counter() - start


EXPORT_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[3])
from benchmarks.hf_io import peak_rss
from freetx.checkpoint import convert
before = peak_rss()
convert(sys.argv[1], sys.argv[2], to="hf", max_shard_size="1GB")
print(json.dumps({"growth": peak_rss() - before}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset", default="llama3_1b", help="a decoder preset (default llama3_1b)"
    )
    parser.add_argument("--dir", help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder, dcp_dir, exported = Path(tmp) / "hf", Path(tmp) / "dcp", Path(tmp) / "out"
        written = write_folder(args.preset, folder)
        raw = raw_read_seconds(folder)
        raw = min(raw, raw_read_seconds(folder))  # warm page cache, both sides
        loaded = launch(Path(__file__), 2, "--load", str(folder), str(dcp_dir), timeout=3600)
        probe = subprocess.run(
            [sys.executable, "-c", EXPORT_PROBE, str(dcp_dir), str(exported),
             str(Path(__file__).resolve().parents[1])],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        export_growth = json.loads(probe.stdout.strip().splitlines()[-1])["growth"]
        shards = sorted(exported.glob("*.safetensors"))
        largest = max(p.stat().st_size for p in shards)
    model_bytes = written["model_bytes"]
    print(f"{args.preset}: {model_bytes / 4 / 1e9:.2f}B parameters, {model_bytes / 2**30:.2f} GiB "
          f"in fp32, HF folder of {SHARD} shards; 2 processes, FSDP, gloo")  # fmt: skip
    rows = [[f"rank {r}", f"{g / 2**20:,.0f}", f"{g / model_bytes:.2f}"]
            for r, g in enumerate(loaded["growth_per_rank"])]  # fmt: skip
    print(table(rows, ["load", "peak RSS growth MiB", "/ model bytes (target <= 0.6)"]))
    print(table(
        [["freetx load (2 ranks, FSDP)", f"{loaded['seconds']:.2f}", f"{loaded['seconds'] / raw:.2f}"],
         ["raw read of the files (1 process)", f"{raw:.2f}", "1.00"]],
        ["", "seconds", "ratio"],
    ))  # fmt: skip
    print(table(
        [["export DCP -> HF", f"{largest / 2**20:,.0f}", f"{export_growth / 2**20:,.0f}",
          f"{export_growth / largest:.2f}"]],
        ["", "largest shard MiB", "peak RSS growth MiB", "/ largest shard (target <= 1.2)"],
    ))  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--load":
        load_on_ranks(sys.argv[2], sys.argv[3])
    else:
        main()

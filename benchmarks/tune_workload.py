"""torchtune's full_finetune_distributed workload: freetx through the CLI vs a bare FSDP2
loop of the same shape, interleaved rounds, medians.

The workload (llm/tiny_llama_bench): a tiny Llama-3 (vocab 512, dim 256, 4 layers,
4 heads, MLP 768, untied), sequences of 256, 8 per rank on 2 ranks x 1 thread, fp32,
AdamW foreach, constant lr, no clipping, FSDP2 per block + root, 30 steps, steps
6-30 timed, a log line every step. Printed per side: steady tokens/s over all ranks,
launch -> end of the first step (seconds, from starting the command), peak RSS of a
rank (MiB), and each figure's ratio to the first side's.

    python benchmarks/tune_workload.py [--rounds 3] [--compile]
        [--torchtune benchmarks/torchtune/run.sh]   # torchtune 0.6.1 too (its README)

`--compile` adds freetx with per-block torch.compile (its first round compiles; later
rounds read inductor's cache, as a user's second run does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, table  # noqa: E402

TOKENS_PER_STEP = 2 * 8 * 256
BASE_KEYS = ("tokens_per_s", "startup_s", "rss_mib")  # what every side reports
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def freetx_round(tmp: Path, *overrides: str, nproc: int = 2, env: dict | None = None) -> dict:
    """One `freetx run` of llm/tiny_llama_bench: steady tokens/s (steps 6-30), launch ->
    end of step 1, step 1 alone (s), peak RSS of a rank (MiB)."""
    out = Path(tempfile.mkdtemp(dir=tmp))  # a fresh run folder each round
    start = time.time()
    subprocess.run([sys.executable, "-m", "freetx", "run", "--nproc-per-node", str(nproc),
                    "full_finetune_fsdp2", "--config", "llm/tiny_llama_bench",
                    f"output_dir={out}", *overrides], env={**ENV, **(env or {})}, check=True,
                   capture_output=True)  # fmt: skip
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    times = {r["step"]: r["time"] for r in steps}
    rss = max(r.get("memory/max_rss_gib", 0) for r in records) * 1024
    return {"tokens_per_s": 25 * TOKENS_PER_STEP / (times[30] - times[5]),
            "startup_s": times[1] - start, "rss_mib": rss,
            "step1_s": steps[0]["step_time_s"]}  # fmt: skip


BARE = r"""
import json, resource, sys, time
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from freetx.models.transformer import decoder
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
model = decoder(vocab_size=512, hidden_dim=256, num_layers=4, num_heads=4, num_kv_heads=4,
                ffn_hidden_dim=768, max_seq_len=256, rope_theta=5e5, tie_embeddings=False)
for block in model.layers:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0, foreach=True)
g = torch.Generator().manual_seed(rank)
times = []
for step in range(1, 31):
    x = torch.randint(0, 512, (8, 257), generator=g)
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)  # a log line every step
    times.append(time.time())
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
peak = torch.tensor([rss]); dist.all_reduce(peak, op=dist.ReduceOp.MAX)
if rank == 0:
    json.dump({"t1": times[0], "t5": times[4], "t30": times[29], "rss_mib": float(peak)},
              open(sys.argv[1], "w"))
dist.barrier(); dist.destroy_process_group()
"""


def bare_round(tmp: Path) -> dict:
    script, out = tmp / "bare.py", tmp / "bare.json"
    script.write_text(BARE)
    start = time.time()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", str(script), str(out)], env=ENV, check=True,
                   capture_output=True)  # fmt: skip
    r = json.loads(out.read_text())
    return {"tokens_per_s": 25 * TOKENS_PER_STEP / (r["t30"] - r["t5"]),
            "startup_s": r["t1"] - start, "rss_mib": r["rss_mib"]}  # fmt: skip


def torchtune_round(command: str) -> dict:
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", command], env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="freetx with compile too")
    parser.add_argument("--torchtune", metavar="RUN_SH", help="torchtune's run.sh (its README)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sides = {
            "bare FSDP2": lambda: bare_round(Path(tmp)),
            "freetx": lambda: freetx_round(Path(tmp)),
        }
        if args.torchtune:
            sides = {"torchtune 0.6.1": lambda: torchtune_round(args.torchtune), **sides}
        if args.compile:
            sides["freetx compile"] = lambda: freetx_round(Path(tmp), "distributed.compile=true")
        results = {side: [] for side in sides}
        for _ in range(args.rounds):  # interleaved: every side shares the machine's drift
            for side, run in sides.items():
                results[side].append(run())
    medians = {side: {k: statistics.median(r[k] for r in rounds) for k in BASE_KEYS}
               for side, rounds in results.items()}  # fmt: skip
    base = next(iter(medians.values()))
    rows = [[side, f"{m['tokens_per_s']:,.0f}", f"{m['tokens_per_s'] / base['tokens_per_s']:.2f}",
             f"{m['startup_s']:.1f}", f"{m['startup_s'] / base['startup_s']:.2f}",
             f"{m['rss_mib']:,.0f}", f"{m['rss_mib'] / base['rss_mib']:.2f}"]
            for side, m in medians.items()]  # fmt: skip
    print(f"torchtune's workload, 2 ranks x 1 thread, medians of {args.rounds} interleaved "
          f"rounds; ratios to {next(iter(medians))}")  # fmt: skip
    print(table(rows, ["", "tokens/s", "ratio", "launch->step 1 s", "ratio", "peak RSS MiB",
                       "ratio"]))  # fmt: skip


if __name__ == "__main__":
    main()

"""A context- or tensor-parallel layout of size 1 against the plain run, side by side.

`distributed.cp=1` and `distributed.tp=1` build no mesh and slice nothing
(`freetx.distributed.build_groups` makes the (dp, cp, tp) mesh only for an axis above
1), so the two runs execute the same code: the ratio says that nothing was added to a
run that does not ask for the axes, and what the machine's run-to-run noise is. Rounds
alternate between the two. One process through the CLI (on one GPU: `--device cuda`,
where a tp or cp of 2 cannot be measured), llm/small's decoder.

    python benchmarks/mesh_size_one.py [--device cuda] [--steps 60] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, table  # noqa: E402

LAYOUTS = {"plain fsdp": [], "cp 1 x tp 1": ["distributed.cp=1", "distributed.tp=1"]}


def seconds_per_step(device: str, steps: int, batch: int, seq_len: int, extra: list[str]) -> float:
    """The median step time of the logged windows after the first (warm-up, compile)."""
    with tempfile.TemporaryDirectory() as out:
        dtype = "bfloat16" if device == "cuda" else "float32"
        cmd = [sys.executable, "-m", "freetx", "run", "--nproc-per-node", "1",
               "full_finetune_fsdp2", "--config", "llm/small", f"device={device}",
               f"output_dir={out}", f"max_steps={steps}", "log_every_n_steps=10",
               f"batch_size={batch}", f"dataset.seq_len={seq_len}", "eval.every_n_steps=0",
               "eval.max_batches=1", "checkpoint.every_n_steps=0", "checkpoint.save_final=false",
               "resume=never", "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]",
               f"distributed.mixed_precision.param_dtype={dtype}", *extra]  # fmt: skip
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(result.stderr[-3000:])
        records = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]
    return statistics.median(batch * seq_len / rate for rate in rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None, help="default: 32 on cuda, 4 on cpu")
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    batch = args.batch or (32 if args.device == "cuda" else 4)
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for _ in range(args.rounds):
        for name, extra in LAYOUTS.items():
            times[name].append(
                seconds_per_step(args.device, args.steps, batch, args.seq_len, extra)
            )
    plain = statistics.median(times["plain fsdp"])
    rows = [[name, f"{statistics.median(t):.4f}", f"{statistics.median(t) / plain:.3f}"]
            for name, t in times.items()]  # fmt: skip
    print(f"llm/small, 1 process on {args.device}, {batch} x {args.seq_len} tokens per step, "
          f"{args.steps} steps x {args.rounds} rounds (median step of the windows after the first)")  # fmt: skip
    print(table(rows, ["layout", "s / step", "ratio"]))


if __name__ == "__main__":
    main()

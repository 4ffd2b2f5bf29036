"""Algorithm Distillation over several goal splits: AD and its ED control, each split
with its own history and training seed, on 2 processes through the CLI; then the
held-out returns per split, and their mean and spread across splits and seeds.

    python benchmarks/ad_splits.py [--splits 0 1 2] [--root runs/ad_splits] [--no-ed]

Each run is `freetx run --nproc-per-node 2 ad_ddp --config ad/darkroom_tiny
env.split_seed=S histories.seed=S seed=S output_dir=ROOT/ad_sS` (ad/darkroom_ed for
the control); a finished run is read again, not retrained. The temperature is the
one chosen on the split's validation goals; the test goals were evaluated once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import table  # noqa: E402


def run(config: str, split: int, output_dir: Path, nproc: int, extra: list[str]) -> dict:
    result = output_dir / "eval" / "in_context_returns.json"
    if not (result.is_file() and "test" in json.loads(result.read_text())):
        start = time.perf_counter()
        command = [sys.executable, "-m", "freetx", "run", "--nproc-per-node", str(nproc),
                   "ad_ddp", "--config", config, f"env.split_seed={split}",
                   f"histories.seed={split}", f"seed={split}", f"output_dir={output_dir}",
                   *extra]  # fmt: skip
        subprocess.run(command, check=True)
        print(f"{config} split {split}: {time.perf_counter() - start:.0f} s", flush=True)
    return json.loads(result.read_text())


def summary(name: str, results: dict[int, dict]) -> list[list[str]]:
    rows = []
    for split, r in results.items():
        curve = r["test"]["returns_per_episode"]
        first2, last5 = sum(curve[:2]) / 2, sum(curve[-5:]) / 5
        rows.append([name, str(split), f"{r['temperature']:g}", f"{first2:.2f}", f"{last5:.2f}",
                     f"{last5 / max(first2, 1e-9):.1f}x", f"{r['test']['optimal_return']:.2f}"])  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--root", default="runs/ad_splits")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--no-ed", action="store_true", help="AD only")
    parser.add_argument("overrides", nargs="*", help="key=value for both configs")
    args = parser.parse_args()
    root = Path(args.root)
    kinds = [("AD", "ad/darkroom_tiny", "ad")] + (
        [] if args.no_ed else [("ED", "ad/darkroom_ed", "ed")]
    )
    results = {name: {s: run(cfg, s, root / f"{short}_s{s}", args.nproc, args.overrides)
                      for s in args.splits} for name, cfg, short in kinds}  # fmt: skip
    rows = [row for name in results for row in summary(name, results[name])]
    print(table(rows, ["run", "split", "T (val)", "first 2", "last 5", "ratio", "optimal"]))
    for name, per_split in results.items():
        last5 = [sum(r["test"]["returns_per_episode"][-5:]) / 5 for r in per_split.values()]
        seeds = [v for r in per_split.values() for v in r["test"]["last5_per_seed"]]
        spread = statistics.stdev(last5) if len(last5) > 1 else 0.0
        print(f"{name}: last 5 episodes, mean over splits {statistics.mean(last5):.2f} "
              f"(std {spread:.2f}, min {min(last5):.2f}); over {len(seeds)} split x seed runs "
              f"mean {statistics.mean(seeds):.2f}, std {statistics.stdev(seeds):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()

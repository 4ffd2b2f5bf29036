"""Algorithm Distillation over goal splits drawn at run time: each split with its own
histories and training seed, on 2 processes through the CLI; then the held-out returns
per split and per goal against the optimum, and the learning curve in context.

    python benchmarks/ad_splits.py --splits 5             # 5 split seeds drawn now
    python benchmarks/ad_splits.py --seed-list 0 1 2      # these splits
    python benchmarks/ad_splits.py --splits 3 --ed        # and the ED control on each
    python benchmarks/ad_splits.py --splits 3 --compressed  # and compressed AD on each
    python benchmarks/ad_splits.py --seed-list 0 -- histories.planning_sweeps=20  # overrides
    python benchmarks/ad_splits.py --source --seed-list 0 1 -- histories.planning_sweeps=20
        # no training: the source's histories (ad/darkroom_tiny's, and with the overrides)

Each run is `freetx run --nproc-per-node 2 ad_ddp --config ad/darkroom_tiny
env.split_seed=S histories.seed=S seed=S output_dir=ROOT/ad_sS` (ad/darkroom_ed for the
control, ad/darkroom_compressed for compressed AD); a finished run is read again, not
retrained (runs with overrides have folders of their own, named by a hash of the
overrides). The temperature is the one chosen on the split's validation goals; the test
goals were evaluated once. Beside the returns, each run's cost: its context (tokens at
most), median step time and the fullest rank's peak memory, from its metrics.jsonl. The
goal (docs/recipes/ad_ddp.md): every split's last-5 return >= 80% of its optimum, every
test goal's mean >= 8.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import medians, step_records, table  # noqa: E402

SHARE_OF_OPTIMUM, GOAL_FLOOR = 0.8, 8.0
CURVE_EPISODES = (1, 2, 5, 10, 15, 20, 25, 30)


def run(config: str, split: int, output_dir: Path, nproc: int, extra: list[str]) -> dict:
    """One split's run (trained unless finished); its eval/in_context_returns.json."""
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


def last5(curve: list[float]) -> float:
    return sum(curve[-5:]) / 5


def cost(output_dir: Path) -> list[str]:
    """A run's context (tokens at most, from its config.yaml), median step time and the
    fullest rank's peak memory (RSS on a CPU, allocated on CUDA; from its metrics.jsonl)."""
    from omegaconf import OmegaConf

    from freetx.data.darkroom import compressed_length

    cfg = OmegaConf.load(output_dir / "config.yaml")
    c = cfg.get("compress")
    context = (compressed_length(c.region_episodes, c.regions, cfg.env.horizon) if c
               else cfg.model.n_transit)  # fmt: skip
    records = step_records(output_dir / "metrics.jsonl")
    step = medians(records, ["step_time_s"], after=2)["step_time_s"]
    logged = {key for r in records for key in r}
    key = next(k for k in ("memory/peak_allocated_gib", "memory/max_rss_gib") if k in logged)
    peak = max(r[key] for r in records if key in r)
    return [str(context), f"{step * 1000:.0f} ms", f"{peak:.2f} GiB"]


def split_rows(name: str, results: dict[int, dict], dirs: dict[int, Path]) -> list[list[str]]:
    rows = []
    for split, r in results.items():
        test = r["test"]
        curve, optimal = test["returns_per_episode"], test["optimal_return"]
        rows.append([name, str(split), f"{r['temperature']:g}", f"{sum(curve[:2]) / 2:.2f}",
                     f"{last5(curve):.2f}", f"{optimal:.2f}", f"{last5(curve) / optimal:.0%}",
                     f"{min(test['last5_per_goal']):.2f}", *cost(dirs[split])])  # fmt: skip
    return rows


def goal_rows(name: str, results: dict[int, dict], dirs: dict[int, Path]) -> list[list[str]]:
    """Per test goal: its cell, optimum (walk straight there, then stay: the run's room),
    last-5 return, and of its runs (seeds), those that reached the goal in some episode
    and those that reached it but ended below half its optimum (found it, did not stay:
    from each run's curve, in runs whose report has them). The start cell is marked: held
    out, it is the goal no history shows rewarded (docs/recipes/ad_ddp.md)."""
    import numpy as np
    from omegaconf import OmegaConf

    from freetx.envs import DarkRoomConfig, optimal_return

    rows = []
    for split, r in results.items():
        env = OmegaConf.load(dirs[split] / "config.yaml").env
        goals = np.array(r["test"]["goals"])
        optima = optimal_return(goals, DarkRoomConfig(grid_size=env.grid_size, horizon=env.horizon))
        runs = np.array(r["test"].get("returns", [[[]]] * len(goals)))  # goal, seed, episode
        for (x, y), optimal, value, curves in zip(goals, optima, r["test"]["last5_per_goal"], runs):
            reached = left = ""
            if curves.size:
                found = (curves > 0).any(-1)
                reached = f"{found.sum()}/{len(curves)}"
                left = str((found & (curves[:, -5:].mean(-1) < optimal / 2)).sum())
            start = " (start)" if x == y == env.grid_size // 2 else ""
            rows.append([name, str(split), f"({x}, {y}){start}", f"{optimal:g}", f"{value:.2f}",
                         f"{value / optimal:.0%}", reached, left])  # fmt: skip
    return rows


def verdict(name: str, results: dict[int, dict]) -> str:
    shares = [last5(r["test"]["returns_per_episode"]) / r["test"]["optimal_return"]
              for r in results.values()]  # fmt: skip
    goals = [v for r in results.values() for v in r["test"]["last5_per_goal"]]
    below = sum(v < GOAL_FLOOR for v in goals)
    ok = min(shares) >= SHARE_OF_OPTIMUM and below == 0
    return (f"{name}: last 5 episodes {statistics.mean(shares):.0%} of the optimum on average "
            f"(min {min(shares):.0%} over {len(shares)} splits); {below} of {len(goals)} test "
            f"goals below {GOAL_FLOOR:g} (min {min(goals):.2f}) -> "
            f"{'meets' if ok else 'misses'} the goal (every split >= "
            f"{SHARE_OF_OPTIMUM:.0%}, every goal >= {GOAL_FLOOR:g})")  # fmt: skip


SOURCE_EPISODES = (1, 5, 10, 15, 20, 30, 60)


def source_rows(name: str, split: int, overrides: list[str]) -> list[str]:
    """The source algorithm's learning on a split's training goals, as AD sees it: the
    streams' mean return per episode as a share of each goal's optimum (from the stream's
    start: the centre, or with `histories.random_start` its own cell), the streams whose
    last episode is below 80% of it (a detour kept, or no goal found), the worst goal, and
    of the streams that found their goal before their last episode, those rewarded again
    the episode after (the source goes back to a goal it found: what AD learns to do); and
    of the streams whose goal is one of the farthest cells (7 or more steps from the start:
    from the centre of 9x9, 7 or 8), those that did not find it within the `eval.episodes`
    an in-context run has (of the history as AD reads it: with `histories.subsample` k,
    every k-th episode)."""
    import numpy as np

    from freetx.cli.common import load_recipe
    from freetx.config.run_config import load_recipe_config
    from freetx.data.darkroom import subsample_episodes
    from freetx.envs import goal_split, learning_histories, optimal_return

    cfg = load_recipe_config("ad/darkroom_tiny", [f"env.split_seed={split}",
                             f"histories.seed={split}", *overrides], load_recipe("ad_ddp").schema)  # fmt: skip
    env, histories = cfg.env, cfg.histories
    goals = goal_split(env).train
    made = learning_histories(np.arange(len(goals)), goals, env, histories)
    made = subsample_episodes(made, histories.subsample, env.horizon)  # as the recipe loads them
    length = made["rewards"].shape[1]
    returns = made["rewards"].reshape(len(goals), -1, length // env.horizon, env.horizon)
    first_cells = made["states"][:, 0].reshape(len(goals), -1)  # each stream's start
    starts = np.stack([first_cells // env.grid_size, first_cells % env.grid_size], -1)
    optima = optimal_return(goals[:, None], env, starts)  # goal, stream
    share = returns.sum(-1) / optima[:, :, None]  # goal, stream, episode
    by_episode = share.mean((0, 1))
    rewarded = returns.sum(-1).reshape(-1, share.shape[-1]) > 0  # stream, episode
    first = rewarded.argmax(-1)
    found = rewarded.any(-1) & (first < rewarded.shape[1] - 1)
    back = rewarded[found.nonzero()[0], first[found] + 1]
    distance = np.abs(goals[:, None] - starts).sum(-1)  # goal, stream
    farthest = 2 * (env.grid_size // 2)  # a corner's distance from the centre
    far = (distance >= farthest - 1).reshape(-1)  # per stream
    missed = ~rewarded[far, : cfg.eval.episodes].any(-1)
    return (
        [name, str(split)]
        + [f"{by_episode[e - 1]:.2f}" if e <= len(by_episode) else "" for e in SOURCE_EPISODES]
        + [
            f"{(share[:, :, -1] < SHARE_OF_OPTIMUM).mean():.0%}",
            f"{share[:, :, -1].mean(1).min():.2f}",
            f"{back.mean():.0%}" if len(back) else "",
            f"{missed.mean():.0%} of {len(missed)}" if len(missed) else "none",
        ]
    )


def sources(splits: list[int], overrides: list[str]) -> None:
    variants = {"ad/darkroom_tiny": []} | ({" ".join(overrides): overrides} if overrides else {})
    rows = [source_rows(name, s, extra) for name, extra in variants.items() for s in splits]
    print("the source's return as a share of the optimum, per episode of its history:")
    print(table(rows, ["histories", "split", *[f"ep {e}" for e in SOURCE_EPISODES],
                       "streams < 80% at the end", "worst goal",
                       "back the episode after finding",
                       "far goals not found in the evaluation's episodes"]))  # fmt: skip


def first_curve(per_split: dict[int, dict]) -> list[float]:
    return next(iter(per_split.values()))["test"]["returns_per_episode"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", type=int, default=5, help="split seeds drawn at run time")
    parser.add_argument("--seed-list", type=int, nargs="+", help="these split seeds instead")
    parser.add_argument("--root", default="runs/ad_splits")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--ed", action="store_true", help="the ED control on each split too")
    parser.add_argument("--compressed", action="store_true", help="compressed AD on each too")
    parser.add_argument("--source", action="store_true", help="the source's histories only")
    parser.add_argument("overrides", nargs="*", help="key=value for every run (after --)")
    args = parser.parse_args()
    splits = args.seed_list or random.SystemRandom().sample(range(1000), args.splits)
    print(f"split seeds: {' '.join(map(str, splits))}", flush=True)
    if args.source:
        sources(splits, args.overrides)
        return
    root = Path(args.root)
    kinds = [("AD", "ad/darkroom_tiny", "ad")]
    kinds += [("compressed AD", "ad/darkroom_compressed", "cad")] if args.compressed else []
    kinds += [("ED", "ad/darkroom_ed", "ed")] if args.ed else []
    # runs with overrides get their own folders: a finished run is read again, not retrained
    tag = (
        "_" + hashlib.sha1(" ".join(args.overrides).encode()).hexdigest()[:8]
        if args.overrides
        else ""
    )
    dirs = {name: {s: root / f"{short}_s{s}{tag}" for s in splits} for name, _, short in kinds}
    results = {name: {s: run(cfg, s, dirs[name][s], args.nproc, args.overrides) for s in splits}
               for name, cfg, _ in kinds}  # fmt: skip
    print(table([row for name in results for row in split_rows(name, results[name], dirs[name])],
                ["run", "split", "T (val)", "first 2", "last 5", "optimal", "last 5 / optimal",
                 "worst goal", "context", "step", "peak memory"]))  # fmt: skip
    print()
    print(table([row for name in results for row in goal_rows(name, results[name], dirs[name])],
                ["run", "split", "test goal", "optimal", "last 5", "/ optimal",
                 "runs that reached it", "reached it, ended below half"]))  # fmt: skip
    print()
    curves = []
    shown = [e for e in CURVE_EPISODES if e <= len(first_curve(next(iter(results.values()))))]
    for name, per_split in results.items():
        mean = [statistics.mean(r["test"]["returns_per_episode"][e - 1] for r in per_split.values())
                for e in shown]  # fmt: skip
        curves.append([name] + [f"{v:.2f}" for v in mean])
    print("return per in-context episode, mean over the splits' test goals x seeds:")
    print(table(curves, ["run"] + [f"ep {e}" for e in shown]))
    print()
    for name, per_split in results.items():
        print(verdict(name, per_split))


if __name__ == "__main__":
    from freetx.errors import FreetxError

    try:
        main()
    except FreetxError as e:  # a bad override: the one-paragraph message, no traceback
        sys.exit(f"ad_splits: {e}")

"""Advantage estimates on `llm/grpo_tiny`'s task: GRPO's group baseline, RLOO's leave-one-out
and REINFORCE++'s per-token returns (with a KL to the SFT model folded into the reward),
the same policy, prompts and seed, one run each, their reward curves side by side.

The policy is a short SFT of `llm/instruct_tiny` (`--policy`; made here when absent:
`freetx run --nproc-per-node 2 full_finetune_fsdp2 --config llm/instruct_tiny
max_steps=80`, ~1 min, where the greedy count is right ~20% of the time). Each estimate
then trains `--steps` steps of its config on 2 processes: `llm/grpo_tiny`, `llm/rloo_tiny`,
`llm/reinforce_pp_tiny`. Printed every 10 steps: the mean training reward of the 10 steps
before (the policy's own samples at temperature 1) and val/rewards/exact_match/mean (the
greedy success rate on the ~190 held-out prompts), for each estimate.

    OMP_NUM_THREADS=1 python benchmarks/advantages.py              # ~8 minutes on 2 cores
    python benchmarks/advantages.py --policy runs/llm_instruct_tiny --steps 50
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import freetx, table  # noqa: E402

ESTIMATES = {
    "GRPO (group mean / std)": "llm/grpo_tiny",
    "RLOO (leave one out)": "llm/rloo_tiny",
    "REINFORCE++ (+ KL, batch norm)": "llm/reinforce_pp_tiny",
}
JSONL = "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"


def curve(config: str, policy: Path, steps: int, out: Path) -> dict[int, tuple[float, float]]:
    """step -> (the mean training reward of the 10 steps up to it, the greedy validation
    success rate at it) of one run of `config` from `policy`."""
    freetx("run", "--nproc-per-node", "2", "grpo_fsdp2", "--config", config,
           f"model_dir={policy}", f"output_dir={out}", f"max_steps={steps}",
           "log_every_n_steps=1", "checkpoint.every_n_steps=0", "samples.every_n_steps=0",
           JSONL)  # fmt: skip
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r["reward"] for r in rows if "reward" in r}
    val = {r["step"]: r["val/rewards/exact_match/mean"] for r in rows if "val/reward" in r}
    points = {}
    for step in sorted(val):
        window = [train[s] for s in range(max(step - 9, 1), step + 1) if s in train]
        points[step] = (sum(window) / len(window) if window else float("nan"), val[step])
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", type=Path, default=None, help="the SFT run (made if absent)")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        policy = args.policy
        if policy is None or not policy.exists():
            policy = policy or Path(tmp) / "sft"
            freetx("run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config",
                   "llm/instruct_tiny", "max_steps=80", f"output_dir={policy}",
                   "checkpoint.every_n_steps=0", JSONL)  # fmt: skip
        policy = policy.resolve()
        curves = {
            name: curve(config, policy, args.steps, Path(tmp) / config.split("/")[1])
            for name, config in ESTIMATES.items()
        }
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    rows = [[step, *(f"{c[step][0]:.3f} / {c[step][1]:.3f}" for c in curves.values())]
            for step in steps]  # fmt: skip
    print(
        f"llm/grpo_tiny's task from {policy.name}, 2 processes, 16 prompts x 8 completions a step"
    )
    print("each cell: mean training reward of the 10 steps before / greedy validation success")
    print(table(rows, ["step", *curves]))


if __name__ == "__main__":
    main()

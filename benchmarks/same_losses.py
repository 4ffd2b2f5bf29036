"""Does a change keep every number a run logs? Side by side, this tree against a git
revision, on 2 processes: llm/tiny (20 steps), llm/lora_tiny on a shared base (20),
crosscoder/synthetic_tiny (40) and ad/darkroom_tiny (40), every step logged, evaluations
mid-run. Prints, per run, how many logged values were compared and the largest relative
difference (timings and memory left out); exit 1 if any exceeds --tolerance.

    python benchmarks/same_losses.py 9054a5a            # ~9 min on 2 cores
    python benchmarks/same_losses.py main --runs llm_tiny
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = ["log_every_n_steps=1", "resume=never"]
RUNS = {  # name -> (recipe, config, overrides)
    "llm_tiny": ("full_finetune_fsdp2", "llm/tiny",
                 ["max_steps=20", "eval.every_n_steps=10", "checkpoint.every_n_steps=20"]),
    "lora_tiny": ("full_finetune_fsdp2", "llm/lora_tiny",
                  ["max_steps=20", "eval.every_n_steps=10", "checkpoint.every_n_steps=20"]),
    "crosscoder": ("crosscoder_fsdp2", "crosscoder/synthetic_tiny",
                   ["max_steps=40", "eval.every_n_steps=20", "checkpoint.every_n_steps=40"]),
    "ad": ("ad_ddp", "ad/darkroom_tiny",
           ["max_steps=40", "eval.every_n_steps=20", "checkpoint.every_n_steps=40"]),
}  # fmt: skip
NOT_COMPARED = ("tokens_per_s", "step_time", "memory/", "mfu", "time")


def run(tree: Path, name: str, output: Path, base: Path) -> None:
    """One run of `tree`'s recipe and config, with `tree`'s freetx first on the path."""
    recipe, config, overrides = RUNS[name]
    extra = [f"model_dir={base}"] if name == "lora_tiny" else []
    command = [
        sys.executable, "-m", "freetx", "run", "--nproc-per-node", "2",
        str(tree / "recipes" / f"{recipe}.py"), "--config",
        str(tree / "recipe_configs" / f"{config}.yaml"), f"output_dir={output}",
        *COMMON, *overrides, *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{name} failed in {tree}:\n{result.stderr[-3000:]}")


def logged(output: Path) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    for line in (output / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], {}).update(record)
    return steps


def largest_difference(a: dict, b: dict) -> tuple[int, float, str]:
    """(values compared, largest relative difference, where); a value missing on one
    side counts as a difference of infinity."""
    count, worst, where = 0, 0.0, ""
    for step, values in a.items():
        for key, value in values.items():
            if any(s in key for s in NOT_COMPARED) or not isinstance(value, (int, float)):
                continue
            other = b.get(step, {}).get(key)
            diff = float("inf") if other is None else abs(value - other) / max(abs(value), 1e-12)
            count += 1
            if diff > worst:
                worst, where = diff, f"step {step} {key}: {value} vs {other}"
    return count, worst, where


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="the git revision to compare this tree with")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--tolerance", type=float, default=1e-6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        other = root / "other"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(other),
                        args.revision], check=True, capture_output=True)  # fmt: skip
        try:
            base = root / "base"  # one base for both LoRA runs: the revision's llm/tiny
            if "lora_tiny" in args.runs:
                run(other, "llm_tiny", base, base)
            failed = False
            for name in args.runs:
                run(other, name, root / "before" / name, base)
                run(REPO, name, root / "after" / name, base)
                before, after = logged(root / "before" / name), logged(root / "after" / name)
                count, worst, where = largest_difference(before, after)
                failed |= worst > args.tolerance or bool(set(after) - set(before))
                print(f"{name}: {len(before)} steps logged, {count} values compared, largest "
                      f"relative difference {worst:.3g}" + (f" ({where})" if worst else ""))  # fmt: skip
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(other)],
                           capture_output=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

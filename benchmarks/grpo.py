"""Online RL (`grpo_fsdp2`): what its generation and its step cost, measured side by side
in one run, one section each.

- generation with the KV cache vs without: one process, the decoder at its `tiny` shape
  (4 blocks, hidden 192, vocab 259), random weights, 8 prompts of 32
  tokens x 8 completions = 64 rows sampled at temperature 1 for 128 new tokens (no end
  token: every row runs the whole length), through `freetx.models.generation.generate`
  (what the recipe calls): with its KV cache, and with a full forward over the whole
  sequence per token. Figure: generated tokens / second, the median of `--repeats`,
  the two alternating.
- a GRPO step's time split: `llm/grpo_tiny` from random weights through the CLI on 2
  processes (fsdp), 16 prompts x 8 completions of up to 16 tokens, 6 steps; the mean
  over steps 2-6 of what the run logs: time/generation (sampling, its parameters
  gathered once), time/scoring (the rewards), the rest of the rollout (log-probs,
  metrics), time/training (forward, backward, optimizer step).

    OMP_NUM_THREADS=2 python benchmarks/grpo.py                # ~2 minutes on 2 cores
    python benchmarks/grpo.py --section generation
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, table  # noqa: E402


def generation_with_and_without_cache(repeats: int) -> None:
    """Section: tokens/s of `generate` with the KV cache and with a full forward per token."""
    import torch

    from freetx.models.generation import Draws, Sampling, generate
    from freetx.models.transformer import decoder

    rows_out = []
    for preset in ("tiny",):
        torch.manual_seed(0)
        model = decoder(preset=preset, vocab_size=259, max_seq_len=256).eval()
        prompts = [[256, *torch.randint(0, 256, (31,)).tolist()] for _ in range(8)]
        rows = [p for p in prompts for _ in range(8)]
        draws = Draws.keyed([f"row {i}" for i in range(len(rows))], 128)
        seconds = {True: [], False: []}
        for _ in range(repeats):
            for cached in (True, False):
                started = time.perf_counter()
                out = generate(model, rows, 128, Sampling(1.0), [], draws, use_cache=cached)
                seconds[cached].append(time.perf_counter() - started)
                assert int(out.lengths.sum()) == 128 * len(rows)
        tokens = 128 * len(rows)
        with_cache = tokens / statistics.median(seconds[True])
        without = tokens / statistics.median(seconds[False])
        params = sum(p.numel() for p in model.parameters()) / 1e6
        rows_out.append([f"{preset} ({params:.1f}M)", f"{with_cache:,.0f}", f"{without:,.0f}",
                         f"{with_cache / without:.1f}x"])  # fmt: skip
    print("generation: 64 rows (8 prompts of 32 tokens x 8), 128 new tokens, fp32, one process")
    print(table(rows_out, ["model", "KV cache tokens/s", "full forward tokens/s", "ratio"]))


def step_time_split() -> None:
    """Section: a GRPO step's time by phase, from the run's own metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "grpo"
        command = [
            sys.executable, "-m", "freetx", "run", "--nproc-per-node", "2", "grpo_fsdp2",
            "--config", "llm/grpo_tiny", "model_dir=null", f"output_dir={out}", "max_steps=6",
            "log_every_n_steps=1", "eval.every_n_steps=0", "eval.max_batches=1",
            "samples.every_n_steps=0", "checkpoint.every_n_steps=0",
            "rewards=[{_component_: freetx.objectives.RegexFormat, pattern: '(?s).*[aeiou].*'}]",
            "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]",
        ]  # fmt: skip
        subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "time/training" in r and r["step"] >= 2]
    mean = {k: statistics.mean(r[k] for r in steps)
            for k in ("time/generation", "time/scoring", "time/rollout", "time/training",
                      "generation/tokens_per_s", "tokens_per_s")}  # fmt: skip
    other = mean["time/rollout"] - mean["time/generation"] - mean["time/scoring"]
    total = mean["time/rollout"] + mean["time/training"]
    parts = [("generation", mean["time/generation"]), ("scoring", mean["time/scoring"]),
             ("rest of the rollout", other), ("training", mean["time/training"])]  # fmt: skip
    print("a GRPO step: llm/grpo_tiny, random weights, 2 processes (fsdp), 16 prompts x 8, "
          "steps 2-6")  # fmt: skip
    print(table([[name, f"{s:.3f}", f"{100 * s / total:.0f}%"] for name, s in parts]
                + [["step", f"{total:.3f}", "100%"]], ["phase", "seconds", "share"]))  # fmt: skip
    print(
        f"generation {mean['generation/tokens_per_s']:,.0f} tokens/s, training "
        f"{mean['tokens_per_s']:,.0f} tokens/s (per run, all ranks)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--section", choices=("generation", "step"), default=None)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.section in (None, "generation"):
        generation_with_and_without_cache(args.repeats)
    if args.section in (None, "step"):
        step_time_split()


if __name__ == "__main__":
    main()

"""Greedy replies of trained models to held-out built-in prompts, by task: how many are the
right answer, and how many the plausible wrong one the built-in preference pairs reject
(`freetx.data.preference.builtin_pairs`). The prompts: the last 300 of the 4,000 built-in
pairs of seed 0 (`num_builtin_examples: 4000`, as llm/dpo_tiny); each reply is read up to
its EOS (16 new tokens at most), stripped, and compared whole.

    python benchmarks/builtin_greedy.py runs/llm_instruct_tiny runs/llm_dpo_tiny ...
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import table  # noqa: E402
from freetx.checkpoint.loading import load_model  # noqa: E402
from freetx.data import ByteTokenizer  # noqa: E402
from freetx.data.preference import builtin_pairs  # noqa: E402
from freetx.models.generation import Draws, Sampling, generate  # noqa: E402


def greedy_counts(run: str) -> dict[str, tuple[int, int, int]]:
    """One model's greedy replies to the held-out prompts, by task: (right, the rejected
    answer, prompts)."""
    tok = ByteTokenizer()
    records = [r.fields for r in builtin_pairs(4000, 0)[-300:]]
    prompts = [[tok.bos_id, *tok.encode(r["prompt"])] for r in records]
    tasks = [r["prompt"].split(":")[0].split("?")[0].split(" in ")[0] for r in records]
    model = load_model(run, torch.device("cpu"))
    right, rejected, count = collections.Counter(), collections.Counter(), collections.Counter()
    for prompt, record, task in zip(prompts, records, tasks):  # alone: no padding
        out = generate(model, [prompt], 16, Sampling(0.0), [tok.eos_id], Draws.keyed([""], 16))
        ids = out.replies()[0]
        reply = tok.decode(ids[:-1] if bool(out.ended[0]) else ids).strip()
        count[task] += 1
        right[task] += reply == record["chosen"]
        rejected[task] += reply == record["rejected"]
    return {task: (right[task], rejected[task], count[task]) for task in count}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run folders, DCP checkpoints or HF folders")
    args = p.parse_args()
    rows = []
    for run in args.runs:
        counts = greedy_counts(run)
        rows += [[run, task, f"{r}/{n}", rejected] for task, (r, rejected, n) in counts.items()]
    print(table(rows, ["model", "task", "right", "the rejected answer"]))


if __name__ == "__main__":
    main()

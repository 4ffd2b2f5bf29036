"""A judge sharded like the policy on N ranks (run by test_hf_loading.py).

Arguments: the judge's HF folder (with its tokenizer). The policy (the same folder's
model) is parallelized under fsdp; the judge placed with its plan holds its share of
each weight, is gathered whole while it scores (each rank its own completions, as many as
its rank plus one: forwards that differ between ranks) and sharded again after; its
scores and the elements each rank holds before, while and after are recorded for the
test to compare with a whole judge on one process.
"""

from __future__ import annotations

import sys

import torch

from freetx.distributed import init_distributed
from freetx.objectives import Judge
from tests.distributed.launcher import folder_plan, write_results

TEMPLATE = "Question: {prompt}\nAnswer: {completion}\nRight?"
COMPLETIONS = ["4", "blue, mostly", "five", "no idea at all"]


def held(model: torch.nn.Module) -> int:
    """The elements of the model's parameters this rank holds."""
    return sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())


def main() -> None:
    folder = sys.argv[1]
    runtime = init_distributed("cpu")
    plan = folder_plan(folder, runtime)
    judge = Judge(folder, TEMPLATE)
    judge.place(runtime.device, plan)
    mine = COMPLETIONS[: runtime.rank + 1]
    before = held(judge.model)
    with judge.gathered():
        during = held(judge.model)
        scores = judge(["What is 2+2?"] * len(mine), mine, [[] for _ in mine])
    write_results({"scores": scores, "held": [before, during, held(judge.model)]})


if __name__ == "__main__":
    main()

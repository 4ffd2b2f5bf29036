"""The embedding's padding row under FSDP2 on N ranks (run by test_padding_row.py).

Argument: an HF folder whose config.json sets pad_token_id. Its model (hf_model) is
sharded per block with fsdp, its weights read from the folder; one forward and backward
on a batch holding the pad id; the embedding's full gradient is recorded.
"""

from __future__ import annotations

import sys

from freetx.checkpoint import load_initial_weights
from freetx.distributed import init_distributed
from tests.distributed.launcher import folder_plan, write_results
from tests.unit.test_padding_row import batch_with_pads, loss


def main() -> None:
    folder = sys.argv[1]
    runtime = init_distributed("cpu")
    plan = folder_plan(folder, runtime)
    load_initial_weights(plan.model, folder)
    ids = batch_with_pads()
    loss(plan.model.eval()(ids), ids).backward()
    grad = plan.module.tok_embeddings.weight.grad
    write_results({"grad": grad.full_tensor().tolist()})


if __name__ == "__main__":
    main()

"""HF folders loaded under every strategy on N ranks (run by test_hf_loading.py).

Arguments: the HF folder, then strategies. For each strategy its model (hf_model) is built
from the folder's config.json on the meta device, parallelized, and its weights
read from the folder, each rank reading only its own rows; the logits on fixed
ids and the bytes each rank read are recorded for the test to compare with
transformers' logits and the file sizes.
"""

from __future__ import annotations

import sys

import torch

from freetx.checkpoint import load_initial_weights
from freetx.checkpoint.formats import SafetensorsFile
from freetx.distributed import init_distributed
from tests.distributed.launcher import folder_plan, write_results

bytes_read = 0
_read_into = SafetensorsFile.read_into


def counting_read_into(self, name, rows, out):
    global bytes_read
    _read_into(self, name, rows, out)
    bytes_read += out.numel() * self.entries[name][0].dtype.itemsize


SafetensorsFile.read_into = counting_read_into


def main() -> None:
    global bytes_read
    folder, strategies = sys.argv[1], sys.argv[2:]
    runtime = init_distributed("cpu")
    ids = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(5))
    results = {}
    for strategy in strategies:
        plan = folder_plan(folder, runtime, strategy)
        bytes_read = 0
        load_initial_weights(plan.model, folder)
        with torch.no_grad():
            logits = plan.model.eval()(ids)
        results[strategy] = {"logits": logits.tolist(), "bytes_read": bytes_read}
    write_results(results)


if __name__ == "__main__":
    main()

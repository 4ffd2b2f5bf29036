"""Is reading activations on the crosscoder's critical path? Rows/s side by side, 1 process.

The same crosscoder (3 layers of llm/tiny's decoder, d 192, 768 features, 1024 rows a
step) trained for the same steps with its rows from:
- bare: a tensor already in memory (the crosscoder step alone);
- cache: the activation cache (bf16 safetensors shards), through the data loader;
- buffer: the on-the-fly buffer, the decoder run on the built-in corpus for each refill.
Ratios are rows/s over the bare step's.

    python benchmarks/crosscoder.py [--steps 40]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import table  # noqa: E402

ROWS = 1024
HOOKS = ["layers.1", "layers.2", "layers.3"]


def timed_steps(batches, model, optimizer, steps: int) -> float:
    """Rows/s over `steps` steps after 3 warm-up steps."""
    from freetx.models.crosscoder import CrosscoderLoss, LocalReducer

    loss_fn = CrosscoderLoss(LocalReducer())  # one process
    data = iter(batches)
    for i in range(steps + 3):
        if i == 3:
            start = time.perf_counter()
        x = next(data)["x"]
        (model(x, loss_fn, 1.0).loss / len(x)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps * ROWS / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    import torch

    from freetx.data import ByteTokenizer, PackedTextDataset, build_train_loader
    from freetx.data.activations import (
        ActivationBuffer,
        ActivationHarvester,
        build_activation_cache,
        keep_positions,
    )
    from freetx.data.shard_cache import ShardCache
    from freetx.distributed import materialize
    from freetx.models.crosscoder import crosscoder
    from freetx.models.transformer import decoder

    torch.manual_seed(0)
    with torch.device("meta"):
        lm = decoder("tiny")
    materialize(lm, torch.device("cpu"), seed=0)
    tokenizer = ByteTokenizer()
    text = PackedTextDataset(tokenizer, source="builtin", seq_len=128)
    harvester = ActivationHarvester([(lm, HOOKS, "llm/tiny")])
    drop = [tokenizer.bos_id, tokenizer.pad_id]

    def harvest(input_ids):
        return harvester(input_ids, keep_positions(input_ids, drop))

    def fresh():
        with torch.device("meta"):
            model = crosscoder(num_sources=3, source_dim=192, dict_size=768)
        materialize(model, torch.device("cpu"), seed=0)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        rows = build_activation_cache(ShardCache(Path(tmp) / "cache"), harvest, text, 0, 1,
                                      {"bench": 1}, barrier=lambda: None)  # fmt: skip
        cache_build = time.perf_counter() - start
        memory = rows.rows[: ROWS * 8].float()
        bare = iter(lambda: {"x": memory[torch.randint(0, len(memory), (ROWS,))]}, None)
        model, optimizer = fresh()
        results["bare"] = timed_steps(bare, model, optimizer, args.steps)
        loader = build_train_loader(rows, ROWS, 1, 0, 1, seed=0)
        model, optimizer = fresh()
        results["cache"] = timed_steps(loader, model, optimizer, args.steps)
        buffer = ActivationBuffer(harvest, text, ROWS, 16, 0, 1, seed=0)
        model, optimizer = fresh()
        results["buffer"] = timed_steps(buffer, model, optimizer, args.steps)
    print(f"crosscoder: 3 sources x d 192, 768 features, {ROWS} rows a step, 1 process, "
          f"{args.steps} steps (the cache of {len(rows):,} rows took {cache_build:.1f} s to make)")  # fmt: skip
    print(table([[name, f"{rate:,.0f}", f"{rate / results['bare']:.2f}"]
                 for name, rate in results.items()], ["rows from", "rows/s", "/ bare"]))  # fmt: skip


if __name__ == "__main__":
    main()

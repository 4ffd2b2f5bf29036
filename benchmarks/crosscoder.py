"""Crosscoders on a trained LM's activations: rows/s by source, and features (EV, L0, dead).

The same crosscoder (3 layers of llm/tiny's decoder, d 192, 768 features, 1024 rows a
step) trained for the same steps with its rows from:
- bare: a tensor already in memory (the crosscoder step alone);
- cache: the activation cache (bf16 safetensors shards), through the data loader;
- buffer: the on-the-fly buffer, the decoder run on the built-in corpus for each refill.
Ratios are rows/s over the bare step's.

    python benchmarks/crosscoder.py [--steps 40]

`--features`: the features a crosscoder learns on real activations (layers 1-3 of an LM
trained on the built-in corpus first: llm/tiny's run, `--lm` or trained here), each
variant a 2-process `freetx run` of crosscoder/lm_layers_tiny (600 steps of 1024 rows,
0.6M rows): the seed's encoder (reads x) against the centered one (reads x - b_dec, b_dec
starting at the data's mean: the config's), with ReLU + L1 and BatchTopK (k 32, AuxK on
features unfired for 50 steps). Printed per variant: validation EV and L0 (8192 rows),
the dead fraction over the last 102,400 training rows (100 steps) and over the
validation rows, and the CE loss recovered when the reconstruction is spliced in.

    python benchmarks/crosscoder.py --features [--lm runs/llm_tiny] [--root runs/bench_cc]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import freetx, table  # noqa: E402

ROWS = 1024
HOOKS = ["layers.1", "layers.2", "layers.3"]
VARIANTS = {  # name: overrides of crosscoder/lm_layers_tiny
    "relu, seed's encoder": ["model.apply_b_dec_to_input=false"],
    "relu, centered (config)": [],
    "batchtopk, seed's encoder": ["model.apply_b_dec_to_input=false"],
    "batchtopk, centered": [],
}
BATCHTOPK = ["model.activation=batchtopk", "model.k=32", "model.dead_after_rows=51200"]


def features(lm: Path | None, root: Path) -> None:
    """Train each variant (a finished one is read again) and print its final figures."""
    import json

    if lm is None:
        lm = root / "llm_tiny"
        if not (lm / "checkpoints").is_dir():
            freetx("run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config", "llm/tiny",
                   f"output_dir={lm}", "metric_loggers=[]")  # fmt: skip
    rows = []
    for i, (name, overrides) in enumerate(VARIANTS.items()):
        out = root / f"variant_{i}"
        if not (out / "metrics.jsonl").is_file():
            extra = BATCHTOPK if name.startswith("batchtopk") else []
            start = time.perf_counter()
            freetx("run", "--nproc-per-node", "2", "crosscoder_fsdp2", "--config",
                   "crosscoder/lm_layers_tiny", f"output_dir={out}",
                   f"activations.sources.0.model={lm}", "log_every_n_steps=100",
                   "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]",
                   *extra, *overrides)  # fmt: skip
            print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        final = {key: value for record in records for key, value in record.items()}  # newest
        rows.append([name, f"{final['val/explained_variance']:.3f}", f"{final['val/l0']:.1f}",
                     f"{final['dead_fraction']:.1%}", f"{final['val/dead_fraction']:.1%}",
                     f"{final['val/ce_recovered/model_0']:.3f}"])  # fmt: skip
    print(f"crosscoder/lm_layers_tiny on {lm} (layers 1-3, d 192, 768 features), 2 processes")
    print(table(rows, ["variant", "EV (val)", "L0 (val)", "dead (last 102k rows)",
                       "dead (val)", "CE recovered"]))  # fmt: skip


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
    parser.add_argument("--features", action="store_true", help="EV, L0, dead per variant")
    parser.add_argument("--lm", type=Path, help="a trained llm/tiny run (default: trained here)")
    parser.add_argument("--root", type=Path, default=Path("runs/bench_crosscoder"))
    args = parser.parse_args()
    if args.features:
        features(args.lm and args.lm.resolve(), args.root.resolve())
        return
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

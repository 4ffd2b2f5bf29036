"""The recipe's training step vs a bare hand-written PyTorch loop, side by side.

Same model (llm/tiny's decoder), same data, same global batch, same optimizer,
clipping and LR schedule; the bare loop gets its batches pre-fetched in memory,
the recipe pays for its data loader, accumulation bookkeeping, token counting
and metric logging. Rounds alternate between the two to share the machine's
noise. Prints seconds per step and the ratio, for 1 process and 2-process FSDP2.

    python benchmarks/overhead.py [--steps 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import launch, load_recipe_module, table, write_result  # noqa: E402


def recipe_config(schema, steps: int, output_dir: str):
    from freetx.config import load_recipe_config

    overrides = [
        f"output_dir={output_dir}", f"max_steps={steps}", "log_every_n_steps=10",
        "eval.every_n_steps=0", "eval.max_batches=1", "metric_loggers=[]",
        # each round starts from step 0 and writes nothing (each rank has its own tmp dir)
        "resume=never", "checkpoint.every_n_steps=0", "checkpoint.save_final=false",
    ]  # fmt: skip
    return load_recipe_config("llm/tiny", overrides, schema)


def bare_loop(cfg, runtime, steps: int) -> float:
    """A plain loop a user would write by hand: seconds per step."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    from freetx.data import ByteTokenizer, GlobalBatchSampler, PackedTextDataset
    from freetx.distributed import MeshShape, materialize
    from freetx.models.transformer import decoder

    with torch.device("meta"):
        model = decoder("tiny", vocab_size=259, max_seq_len=256)
    if runtime.world_size > 1:
        mesh = MeshShape("fsdp", dp_shard=runtime.world_size).build(runtime.device_type)["fsdp"]
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    materialize(model, torch.device("cpu"), seed=cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    data = PackedTextDataset(ByteTokenizer(), "builtin", seq_len=cfg.dataset.seq_len)
    sampler = iter(GlobalBatchSampler(len(data), cfg.batch_size, 1, runtime.rank,
                                      runtime.world_size, cfg.seed))  # fmt: skip
    batches = []
    for _ in range(steps):
        samples = [data[i] for i in next(sampler)]
        batches.append((torch.stack([s["input_ids"] for s in samples]),
                        torch.stack([s["labels"] for s in samples])))  # fmt: skip
    start = time.perf_counter()
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    return (time.perf_counter() - start) / steps


def recipe_loop(module, cfg) -> float:
    recipe = module.FullFinetuneRecipeFSDP2(cfg)
    recipe.setup()
    start = time.perf_counter()
    recipe.train()
    elapsed = time.perf_counter() - start
    recipe.cleanup()
    return elapsed / cfg.max_steps


def worker(steps: int, rounds: int) -> None:
    from freetx.distributed import init_distributed

    module, schema = load_recipe_module("full_finetune_fsdp2")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = recipe_config(schema, steps, tmp)
        runtime = init_distributed("cpu")
        recipe_loop(module, recipe_config(schema, 3, tmp))  # warm up both paths once
        bare_loop(cfg, runtime, 3)
        recipe_times, bare_times = [], []
        for _ in range(rounds):
            recipe_times.append(recipe_loop(module, cfg))
            bare_times.append(bare_loop(cfg, runtime, steps))
    write_result({"recipe": statistics.median(recipe_times), "bare": statistics.median(bare_times),
                  "world_size": runtime.world_size})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.rounds)
        return
    rows = []
    for nproc in (1, 2):
        r = launch(Path(__file__), nproc, "--worker", "--steps", str(args.steps),
                   "--rounds", str(args.rounds))  # fmt: skip
        label = "1 process" if nproc == 1 else "2 processes, FSDP2"
        rows.append(
            [label, f"{r['bare']:.4f}", f"{r['recipe']:.4f}", f"{r['recipe'] / r['bare']:.3f}"]
        )
    print("Recipe step vs bare PyTorch loop (llm/tiny, batch 16 x 128 tokens, CPU)")
    print(table(rows, ["setting", "bare s/step", "recipe s/step", "ratio"]))


if __name__ == "__main__":
    main()

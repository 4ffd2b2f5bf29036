"""The Free Transformer's latent path at H = 16: peak memory before and after, side by side.

One forward and backward of the post-sampler path (binary mapper + post-sampler, from
z_logits to R) at a real per-rank micro-batch: free_transformer/8b's before it took 8
accumulation steps, 64 sequences x 2048 tokens = 131,072 tokens, hidden 4096, bf16
(FSDP's compute dtype). Four rows:

- before: what the model did until this change: `binary_mapper` (an int64 one-hot over
  the 2^H codes per token, then the code probabilities G, both [tokens, 2^H]) for either
  post-sampler; the table then a linear layer on that one-hot, the factored one the
  straight-through bits;
- after: `PostSampler` as the model calls it now: the table an index lookup whose
  backward goes over chunks of codes (`CHUNK_ELEMENTS`), the factored one only the
  bits (nothing of size 2^H).

Measured on fake tensors (torch's FakeTensorMode: exact shapes and dtypes, no storage,
no compute) under torch's MemTracker, which counts every tensor alive: the peak of
bytes held, inputs (z_logits, the weight) included. Runs anywhere in seconds.

    python benchmarks/free_transformer_latent.py [--tokens 131072 --hidden 4096 --bits 16]

`--seeds N`: the latent's cost instead, on text. For each of N seeds (drawn at run time
unless `--seed-list` names them), `free_transformer/text_tiny` and its baseline (the same
decoder without the latent: `free_transformer/baseline_tiny` on the same data, batch,
steps and schedule, so the same tokens; the Free Transformer computes one block more, the
encoder's) on 2 CPU processes; per seed the Free Transformer's honest NLL
(`val/honest_nll`: posterior CE + KL, an upper bound on its NLL under the prior), its
`val/prior_ce` and `val/ce`, the KL per token (train, the mean of the last `--last` logged
steps), the tax (honest NLL - the baseline's `val/loss`) and whether the latent collapsed:
Z drawn from the prior predicts as well as Z from the encoder (`val/prior_ce` -
`val/ce` below `--gap` nats), bryanvine's criterion. The KL alone does not say it: below
the free bits it costs nothing, so an encoder can spend up to kappa on bits the decoder
never reads (then the honest NLL pays the KL for nothing).

    python benchmarks/free_transformer_latent.py --seeds 3 [--steps 120] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import freetx, table  # noqa: E402

GIB = 2**30


def before(bits: int, factored: bool):
    """The post-sampler path as the model ran it before: binary_mapper, then the layer."""
    import torch
    import torch.nn.functional as F

    from freetx.models.free_transformer import binary_mapper

    def path(z_logits, weight):
        code, sampled = binary_mapper(z_logits)
        if not factored:
            return F.linear(code, weight)
        probs = torch.sigmoid(z_logits)
        return F.linear(2 * (sampled + (probs - probs.detach())) - 1, weight)

    return path


def after(bits: int, factored: bool, hidden: int):
    """The post-sampler path as the model runs it now."""
    from freetx.models.free_transformer import PostSampler, sample_bits

    sampler = PostSampler(bits, hidden, factored)

    def path(z_logits, weight):
        sampler.weight = weight
        return sampler(sample_bits(z_logits), z_logits)

    return path


def peak_bytes(path, tokens: int, bits: int, hidden: int, factored: bool) -> int:
    """Peak bytes alive over one forward and backward of `path` on fake bf16 tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode():
        inputs = bits if factored else 2**bits
        weight = torch.nn.Parameter(torch.zeros(hidden, inputs, dtype=torch.bfloat16))
        tracker = MemTracker()
        with tracker:
            z_logits = torch.zeros(tokens, bits, dtype=torch.bfloat16, requires_grad=True)
            r = path(z_logits, weight)
            r.backward(torch.ones_like(r))
    return next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]


# the baseline on free_transformer/text_tiny's data, batch and schedule (docs/recipes/free_transformer.md)
BASELINE_ON_TEXT = [
    "batch_size=16", "optimizer.lr=3.0e-3", "lr_schedule.warmup_steps=10",
    "eval.every_n_steps=60", "eval.batch_size=16", "~eval.max_batches", "model.max_seq_len=256",
    "dataset={_component_: freetx.data.PackedTextDataset, source: builtin, seq_len: 128}",
]  # fmt: skip
QUIET = ["log_every_n_steps=10", "checkpoint.save_final=false", "resume=never",
         "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"]  # fmt: skip


def trained(config: str, overrides: list[str], out: Path) -> list[dict]:
    """A 2-process run of `config`; its metrics.jsonl's records."""
    freetx("run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config", config,
           f"output_dir={out}", *QUIET, *overrides)  # fmt: skip
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def last_value(records: list[dict], key: str) -> float:
    return [r[key] for r in records if key in r][-1]


def latent_cost(args: argparse.Namespace) -> None:
    import math

    seeds = args.seed_list or random.SystemRandom().sample(range(1000), args.seeds)
    rows, taxes, collapsed = [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            given = [f"seed={seed}", f"max_steps={args.steps}"]
            mine = [f"loss.kappa_bits={args.kappa}", *args.overrides]
            ft = trained("free_transformer/text_tiny", given + mine, Path(tmp) / f"ft{seed}")
            base = trained("free_transformer/baseline_tiny", BASELINE_ON_TEXT + given,
                           Path(tmp) / f"base{seed}")  # fmt: skip
            kl = statistics.mean([r["kl_bits"] for r in ft if "kl_bits" in r][-args.last :])
            honest, baseline = last_value(ft, "val/honest_nll"), last_value(base, "val/loss")
            prior, posterior = last_value(ft, "val/prior_ce"), last_value(ft, "val/ce")
            dead = prior - posterior < args.gap
            collapsed += dead
            taxes.append(honest - baseline)
            rows.append([seed, f"{baseline:.3f}", f"{honest:.3f}", f"{honest - baseline:+.3f}",
                         f"{kl:.3f}", f"{prior:.3f}", f"{posterior:.3f}",
                         f"{prior - posterior:+.3f}", "yes" if dead else "no"])  # fmt: skip
    spread = statistics.stdev(taxes) if len(taxes) > 1 else math.nan
    print(f"free_transformer/text_tiny vs its baseline, {args.steps} steps, 2 CPU processes, "
          f"kappa {args.kappa} bit, overrides {args.overrides or 'none'}; KL: mean of the last "
          f"{args.last} logged steps; collapsed: val/prior_ce - val/ce below {args.gap} nats")  # fmt: skip
    print(table(rows, ["seed", "baseline val/loss", "honest NLL", "tax (nats)", "KL bits",
                       "val/prior_ce", "val/ce", "prior - posterior", "collapsed"]))  # fmt: skip
    print(
        f"tax {statistics.mean(taxes):.3f} +- {spread:.3f} nats over {len(seeds)} seeds; "
        f"{collapsed} of {len(seeds)} collapsed"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64 * 2048)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--bits", type=int, default=16)
    p.add_argument("--seeds", type=int, help="the latent's cost on text over this many seeds")
    p.add_argument("--seed-list", type=int, nargs="+", help="these seeds instead of drawn ones")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--last", type=int, default=3, help="logged steps the KL is averaged over")
    p.add_argument("--gap", type=float, default=0.01, help="collapsed: prior - posterior CE below")
    p.add_argument("--kappa", type=float, default=0.5, help="the free bits (loss.kappa_bits)")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE for the Free Transformer's runs")
    args = p.parse_args()
    if args.seeds or args.seed_list:
        latent_cost(args)
        return
    rows = []
    for factored in (False, True):
        old = peak_bytes(before(args.bits, factored), args.tokens, args.bits, args.hidden, factored)
        new = peak_bytes(
            after(args.bits, factored, args.hidden), args.tokens, args.bits, args.hidden, factored
        )
        name = "factored" if factored else "table"
        rows.append([name, f"{old / GIB:.2f}", f"{new / GIB:.3f}", f"{old / new:.0f}x"])
    print(
        f"post-sampler path, one forward + backward: {args.tokens:,} tokens, H = {args.bits}, "
        f"hidden {args.hidden}, bf16 (peak GiB of tensors alive, fake tensors, MemTracker)"
    )
    print(table(rows, ["post-sampler", "before", "after", "before / after"]))
    held = 2 * args.tokens * args.hidden * 2 / GIB
    print(
        f"(of each: R and dL/dR, {held:.2f} GiB, which any form holds; the table's weight and "
        f"its gradient, {2 * args.hidden * 2**args.bits * 2 / GIB:.2f} GiB)"
    )


if __name__ == "__main__":
    main()

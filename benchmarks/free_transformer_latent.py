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
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import table  # noqa: E402

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64 * 2048)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--bits", type=int, default=16)
    args = p.parse_args()
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

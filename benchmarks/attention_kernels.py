"""The decoder's attention kernels on CPU (freetx/models/attention.py), on the tiny preset
(4 layers, hidden 192, 6 heads / 2 KV) at batch 4 x 256 tokens, fp32, one thread:
milliseconds of a forward, and of a forward + backward where the kernel has one
(FlexAttention has no backward on CPU; uncompiled it materializes the scores, as the
explicit kernel does). The kernel is forced in every layer; the fastest of 20 timed calls
(the machine is shared: the minimum is the figure other work disturbs least).

    OMP_NUM_THREADS=1 python benchmarks/attention_kernels.py
"""

from __future__ import annotations

import functools
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import freetx.models.decoder.layers as layers  # noqa: E402
from benchmarks.common import table  # noqa: E402
from freetx.distributed import materialize  # noqa: E402
from freetx.models.transformer import decoder  # noqa: E402

CASES = [  # (what the layers compute, its fields, the kernels that compute it)
    ("causal", {}, ["sdpa", "sdpa_mask", "explicit", "flex"]),
    ("window 64", {"sliding_window": 64}, ["sdpa_mask", "explicit", "flex"]),
    ("window 64 + softcap 50", {"sliding_window": 64, "attn_logit_softcap": 50.0},
     ["explicit", "flex"]),
]  # fmt: skip


def best_ms(step, repeats: int = 20) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    return min(times)


def train_step(model, ids) -> None:
    out = model(ids)
    getattr(out, "logits", out).square().mean().backward()  # an MoE decoder's LMOutput too


def kernel_rows(model, ids, kernels, label: str, repeats: int = 20) -> list[list[str]]:
    """[label, kernel, forward ms, forward + backward ms] of `model` on `ids`, with each of
    `kernels` forced in every layer (FlexAttention: forward only, none on CPU): the
    fastest of `repeats` calls."""
    original = layers.attend
    rows = []
    try:
        for kernel in kernels:
            layers.attend = functools.partial(original, kernel=kernel)
            with torch.no_grad():
                forward = best_ms(functools.partial(model, ids), repeats)
            backward = "none on CPU"
            if kernel != "flex":
                backward = f"{best_ms(functools.partial(train_step, model, ids), repeats):.0f}"
            rows.append([label, kernel, f"{forward:.0f}", backward])
    finally:
        layers.attend = original
    return rows


def main() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # eager FlexAttention says it is not compiled
    ids = torch.randint(0, 259, (4, 256), generator=torch.Generator().manual_seed(0))
    rows = []
    for name, fields, kernels in CASES:
        with torch.device("meta"):
            model = decoder("tiny", **fields)
        materialize(model, torch.device("cpu"), seed=0)
        rows += kernel_rows(model, ids, kernels, name)
    print("tiny decoder, batch 4 x 256, fp32, 1 thread: ms per call (fastest of 20)")
    print(table(rows, ["layers", "kernel", "forward ms", "forward + backward ms"]))


if __name__ == "__main__":
    main()

"""Preference optimization (`dpo_fsdp2`): what its log-probabilities and steps cost,
measured side by side in one run, one section each.

- log-probs at vocab 128k, chunked vs whole: one process, the output layer alone (a
  Linear of hidden 256 to Llama 3's 128,256 tokens), a batch of 4 x 512 tokens (2
  pairs); forward and backward of each token's log-probability
  (`freetx.models.chunked_loss.ChunkedLogProbs`) summed per sequence into the DPO loss
  (`freetx.training.PreferenceLoss`), `num_chunks` 8 vs 1 (the logits made whole).
  peak: the most live tensor bytes during forward and backward (torch's MemTracker:
  what the allocator must hold, not the process's RSS); time: the median seconds of
  `--repeats`, the two alternating so that both see the same machine.

    OMP_NUM_THREADS=2 python benchmarks/dpo.py                  # ~1 minute on 2 cores
    python benchmarks/dpo.py --section logprobs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import table  # noqa: E402

MIB = 2**20


def logprobs_chunked_vs_whole(repeats: int) -> None:
    """Section: per-token log-probs at vocab 128k, chunked (8) vs whole (1), peak and time."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from freetx.models.chunked_loss import ChunkedLogProbs
    from freetx.models.protocol import OutputLayer
    from freetx.training import PreferenceLoss, SequenceLogProbs

    vocab, batch, seq, dim, chunks = 128_256, 4, 512, 256, (8, 1)
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(vocab, dim, generator=g) * dim**-0.5)
    # a function, not a module: MemTracker refuses a module called once per chunk
    layer = OutputLayer(lambda h: torch.nn.functional.linear(h, weight), (weight,), vocab)
    hidden = torch.randn(batch, seq, dim, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[:, : seq // 4] = -100  # the prompt
    tokens = (labels != -100).sum(-1).float()
    reference = SequenceLogProbs(-tokens * 11.5, tokens)  # about ln(vocab) per token
    loss_fn = PreferenceLoss("sigmoid", beta=0.1)

    def step(n: int) -> float:
        start = time.perf_counter()
        logps = ChunkedLogProbs(labels, num_chunks=n)(hidden, layer)
        loss, _ = loss_fn(SequenceLogProbs(logps.sum(-1), tokens), reference)
        loss.backward()
        hidden.grad = weight.grad = None
        return time.perf_counter() - start

    peaks = {}
    for n in chunks:
        tracker = MemTracker()
        tracker.track_external(weight, hidden)
        with tracker:
            step(n)
        peaks[n] = tracker.get_tracker_snapshot("peak")[hidden.device]["Total"]
    times: dict[int, list[float]] = {n: [] for n in chunks}
    for _ in range(repeats):
        for n in chunks:
            times[n].append(step(n))
    seconds = {n: statistics.median(t) for n, t in times.items()}
    rows = [[f"num_chunks={n}", f"{peaks[n] / MIB:.0f}", f"{seconds[n]:.3f}"] for n in chunks]
    rows.append(["8 / 1", f"{peaks[8] / peaks[1]:.2f}", f"{seconds[8] / seconds[1]:.2f}"])
    print(
        f"log-probs at vocab 128k: chunked vs whole ({batch} x {seq} tokens, hidden {dim}, "
        f"vocab {vocab:,}, float32, forward + backward of the DPO loss, "
        f"median of {repeats})"
    )
    print(table(rows, ["log-probs", "peak live MiB", "time s"]))


SECTIONS = {"logprobs": logprobs_chunked_vs_whole}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=sorted(SECTIONS), action="append")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for name in args.section or SECTIONS:
        SECTIONS[name](args.repeats)
        print()


if __name__ == "__main__":
    main()

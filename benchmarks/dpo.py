"""Preference optimization (`dpo_fsdp2`): what its log-probabilities and steps cost,
measured side by side in one run, one section each.

- log-probs at vocab 128k, chunked vs whole: one process, the output layer alone (a
  Linear of hidden 256 to Llama 3's 128,256 tokens), a batch of 4 x 512 tokens (2
  pairs); forward and backward of each token's log-probability
  (`freetx.models.chunked_loss.ChunkedLogProbs`) summed per sequence into the DPO loss
  (`freetx.objectives.PreferenceLoss`), `num_chunks` 8 vs 1 (the logits made whole).
  peak: the most live tensor bytes during forward and backward (torch's MemTracker:
  what the allocator must hold, not the process's RSS); time: the median seconds of
  `--repeats`, the two alternating so that both see the same machine.

- a DPO step vs an SFT step: one process, a decoder of hidden 256 x 4 blocks (vocab
  259), 8 pairs of 128 tokens; LoRA r 8 on every projection; the DPO step (the policy's
  forward and backward, and the reference's forward with the adapters disabled) vs
  an SFT step (forward and backward of the cross-entropy) on the same 16 sequences.
- full DPO, frozen reference vs precomputed: the same model fully trained with AdamW;
  a step with the frozen copy's forward vs a step reading precomputed log-probs; peak
  live bytes (model, copy, gradients, optimizer state, activations) and time.

    OMP_NUM_THREADS=2 python benchmarks/dpo.py                  # ~2 minutes on 2 cores
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
    from freetx.objectives import PreferenceLoss, SequenceLogProbs

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


def _decoder(lora: bool):
    """The benchmarks' decoder, materialized on the CPU (seed 0), with LoRA on every
    projection or fully trained."""
    import torch

    from freetx.distributed import materialize
    from freetx.models.peft import apply_lora
    from freetx.models.transformer import decoder

    with torch.device("meta"):
        model = decoder(vocab_size=259, hidden_dim=256, num_layers=4, num_heads=8,
                        num_kv_heads=4, ffn_hidden_dim=704, max_seq_len=128)  # fmt: skip
        if lora:
            apply_lora(model, ["q", "k", "v", "o", "gate", "up", "down"], rank=8, alpha=16)
    materialize(model, torch.device("cpu"), seed=0)
    return model


def _pairs(pairs: int = 8, seq: int = 128):
    """Input ids and labels of `pairs` pairs (rows chosen, rejected, ...), the prompt's
    quarter of each row without loss."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 259, (2 * pairs, seq), generator=g)
    labels = ids.roll(-1, 1)
    labels[:, : seq // 4] = -100
    return ids, labels


def _timed(steps: dict, repeats: int) -> dict[str, float]:
    """The median seconds of each step function, alternating so that all see the same
    machine (one warm-up each first)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def dpo_step_vs_sft_step(repeats: int) -> None:
    """Section: a LoRA DPO step (live reference: adapters off) vs an SFT step, same tokens."""
    import torch

    from freetx.models.peft import adapters_disabled
    from freetx.objectives import CrossEntropyLoss, PreferenceLoss, sequence_logps

    model = _decoder(lora=True)
    ids, labels = _pairs()
    dpo_loss, sft_loss = PreferenceLoss("sigmoid", beta=0.1), CrossEntropyLoss()

    def dpo() -> None:
        with torch.no_grad(), adapters_disabled(model):
            reference, _ = sequence_logps(model, ids, labels)
        policy, _ = sequence_logps(model, ids, labels)
        dpo_loss(policy, reference)[0].backward()
        model.zero_grad(set_to_none=True)

    def sft() -> None:
        total, _ = sft_loss(model, ids, labels)
        total.backward()
        model.zero_grad(set_to_none=True)

    seconds = _timed({"DPO (LoRA, live reference)": dpo, "SFT": sft}, repeats)
    rows = [[name, f"{value:.3f}"] for name, value in seconds.items()]
    rows.append(["DPO / SFT", f"{seconds['DPO (LoRA, live reference)'] / seconds['SFT']:.2f}"])
    print(f"a DPO step vs an SFT step on the same {ids.shape[0]} x {ids.shape[1]} tokens "
          f"(LoRA r 8, hidden 256 x 4 blocks, float32, median of {repeats})")  # fmt: skip
    print(table(rows, ["step", "time s"]))


def frozen_vs_precomputed_reference(repeats: int) -> None:
    """Section: full DPO with a frozen reference copy vs precomputed log-probs."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from freetx.objectives import PreferenceLoss, sequence_logps

    # the copy keeps requires_grad (MemTracker hooks every parameter it sees) but runs
    # under no_grad only: no gradient of it is ever made
    policy, copy = _decoder(lora=False), _decoder(lora=False).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    ids, labels = _pairs()
    loss_fn = PreferenceLoss("sigmoid", beta=0.1)
    with torch.no_grad():
        stored = sequence_logps(copy, ids, labels)[0]  # what the one pass keeps: 2 floats a row

    def step(reference) -> None:
        logps, _ = sequence_logps(policy, ids, labels)
        loss_fn(logps, reference())[0].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def live():
        with torch.no_grad():
            return sequence_logps(copy, ids, labels)[0]

    steps = {"frozen copy": lambda: step(live), "precomputed": lambda: step(lambda: stored)}
    step(lambda: stored)  # the optimizer's state exists before the peaks are taken
    peaks = {}
    for name, run in steps.items():
        tracker = MemTracker()
        held = (policy, optimizer) if name == "precomputed" else (policy, copy, optimizer)
        tracker.track_external(*held)
        with tracker:
            run()
        peaks[name] = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    seconds = _timed(steps, repeats)
    rows = [[name, f"{peaks[name] / MIB:.1f}", f"{seconds[name]:.3f}"] for name in steps]
    rows.append(["precomputed / frozen", f"{peaks['precomputed'] / peaks['frozen copy']:.2f}",
                 f"{seconds['precomputed'] / seconds['frozen copy']:.2f}"])  # fmt: skip
    print(f"full DPO: frozen reference copy vs precomputed log-probs ({ids.shape[0]} x "
          f"{ids.shape[1]} tokens, hidden 256 x 4 blocks, AdamW, float32, one process = one "
          f"rank, median of {repeats})")  # fmt: skip
    print(table(rows, ["reference", "peak live MiB", "time s"]))


SECTIONS = {
    "logprobs": logprobs_chunked_vs_whole,
    "step": dpo_step_vs_sft_step,
    "reference": frozen_vs_precomputed_reference,
}


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

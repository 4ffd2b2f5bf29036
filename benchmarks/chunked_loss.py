"""The chunked loss at a 128k vocabulary: peak memory per rank and step time of one
training step, `loss.num_chunks` 1 vs 8, measured side by side in one run.

A decoder with Llama 3's vocabulary (128,256 tokens, tied head) and a small body
(hidden 256, 2 layers), so that the output layer's logits dominate as they do at 1B
parameters; a micro-batch of 1 x 2048 tokens per rank, 2 processes, FSDP2 over gloo,
`freetx.objectives.CrossEntropyLoss(num_chunks=N)` as the recipe calls it.
- peak: the most live tensor bytes of this rank during forward and backward (torch's
  FSDPMemTracker: what the allocator must hold, not the process's RSS), the worst rank;
- step: the median seconds of forward + backward + AdamW over `--steps` steps, the two
  settings alternating step by step so that both see the same machine.

    OMP_NUM_THREADS=1 python benchmarks/chunked_loss.py        # ~2 minutes on 2 cores
    OMP_NUM_THREADS=1 python benchmarks/chunked_loss.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import launch, table, write_result  # noqa: E402

VOCAB = 128_256
SEQ_LEN = 2048
CHUNKS = (1, 8)
MIB = 2**20


def worker(steps: int, dtype: str) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from freetx.distributed import DistributedConfig, build_groups, init_distributed, parallelize
    from freetx.models.transformer import decoder
    from freetx.objectives import CrossEntropyLoss

    runtime = init_distributed("cpu")
    cfg = OmegaConf.structured(DistributedConfig(strategy="fsdp"))
    cfg.mixed_precision.param_dtype = dtype
    with torch.device("meta"):
        model = decoder(vocab_size=VOCAB, hidden_dim=256, num_layers=2, num_heads=4,
                        num_kv_heads=2, ffn_hidden_dim=768, max_seq_len=SEQ_LEN,
                        tie_embeddings=True)  # fmt: skip
    plan = parallelize(model, build_groups(runtime, cfg), cfg, 0)
    model = plan.model
    optimizer = plan.build_optimizer(
        OmegaConf.create({"_component_": "torch.optim.AdamW", "lr": 1e-4})
    )
    g = torch.Generator().manual_seed(runtime.rank)
    ids = torch.randint(0, VOCAB, (1, SEQ_LEN + 1), generator=g)
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def step(loss_fn) -> float:
        start = time.perf_counter()
        loss, _ = loss_fn(model, inputs, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    losses = {n: CrossEntropyLoss(num_chunks=n) for n in CHUNKS}
    for loss_fn in losses.values():
        step(loss_fn)  # warm-up; the optimizer state exists from here on
    peaks = {}
    for n, loss_fn in losses.items():
        tracker = FSDPMemTracker(model, optimizer)
        with tracker:
            step(loss_fn)
        peaks[n] = tracker.get_tracker_snapshot("peak")[runtime.device]["Total"]
    times: dict[int, list[float]] = {n: [] for n in CHUNKS}
    for _ in range(steps):
        for n, loss_fn in losses.items():
            times[n].append(step(loss_fn))
    values = torch.tensor(
        [peaks[n] for n in CHUNKS] + [statistics.median(times[n]) for n in CHUNKS],
        dtype=torch.float64,
    )
    dist.all_reduce(values, op=dist.ReduceOp.MAX)  # the worst rank
    write_result({"peak": values[: len(CHUNKS)].tolist(), "step": values[len(CHUNKS) :].tolist()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.dtype)
        return
    result = launch(
        Path(__file__), 2, "--worker", "--steps", str(args.steps), "--dtype", args.dtype
    )
    (whole_peak, peak), (whole_step, chunked_step) = result["peak"], result["step"]
    rows = [
        [f"num_chunks={n}", f"{p / MIB:.0f}", f"{s:.3f}"]
        for n, p, s in zip(CHUNKS, result["peak"], result["step"])
    ]
    rows.append(["8 / 1", f"{peak / whole_peak:.2f}", f"{chunked_step / whole_step:.2f}"])
    print(
        f"One training step per rank, vocab {VOCAB:,}, 1 x {SEQ_LEN} tokens per rank, "
        f"2 processes (FSDP2, gloo), {args.dtype}, median of {args.steps} steps"
    )
    print(table(rows, ["loss", "peak live MiB", "step s"]))


if __name__ == "__main__":
    main()

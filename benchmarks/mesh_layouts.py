"""Each layout of the (dp, cp, tp) mesh on 4 processes, side by side: memory per rank and
step time of one decoder at one global batch.

Per layout, on rank 0 of 4 gloo processes, over AdamW steps of the same decoder
(hidden 256, 4 blocks, 8 heads of which 4 key/value heads, MLP 1024, vocabulary 4096)
on the same global batch, one micro-batch per data-parallel rank (pp: 2): 8 sequences of 1024
tokens (every layout can split it), then 2 of 4096 (a long-context batch: fsdp alone
cannot give 4 ranks a sequence each, so the layouts that split sequences or layers
over the other ranks are compared):
- state: bytes of this rank's parameters, gradients and optimizer state (its local
  shards) after a step;
- saved: the bytes of the tensors autograd keeps for backward, at the end of forward
  (counted by storage, each once; the loss's chunk included); under pp, over the step
  (2 micro-batches through the stages by 1F1B, storages counted once);
- step: seconds per optimizer step (median of the timed steps).
The 4 processes share this machine's cores alike in every layout: compare the ratios.

    python benchmarks/mesh_layouts.py [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import launch, local_bytes, table, write_result  # noqa: E402

LAYOUTS = {"fsdp (dp 4)": (1, 1, 1), "dp 2 x tp 2": (1, 2, 1), "dp 2 x cp 2": (2, 1, 1),
           "cp 2 x tp 2": (2, 2, 1), "pp 2 x dp 2": (1, 1, 2),
           "pp 2 x cp 2": (2, 1, 2)}  # (cp, tp, pp)  # fmt: skip
FIELDS = dict(vocab_size=4096, hidden_dim=256, num_layers=4, num_heads=8, num_kv_heads=4,
              ffn_hidden_dim=1024, max_seq_len=4096, tie_embeddings=False)  # fmt: skip
SCENARIOS = {(8, 1024): list(LAYOUTS),
             (2, 4096): ["dp 2 x cp 2", "dp 2 x tp 2", "cp 2 x tp 2", "pp 2 x cp 2"]}  # fmt: skip
MICRO_BATCHES = 2  # pp: a data-parallel rank's rows in 2 micro-batches through the stages
MIB = 2**20


def worker(cp: int, tp: int, pp: int, steps: int, batch: int, seq: int) -> None:
    import torch
    from omegaconf import OmegaConf

    from freetx.data import TokenBatch
    from freetx.distributed import DistributedConfig, build_groups, init_distributed, parallelize
    from freetx.models.transformer import decoder
    from freetx.objectives import CrossEntropyLoss

    runtime = init_distributed("cpu")
    cfg = OmegaConf.structured(DistributedConfig(strategy="fsdp", cp=cp, tp=tp, pp=pp))
    groups = build_groups(runtime, cfg)
    with torch.device("meta"):
        model = decoder(**FIELDS)
    plan = parallelize(model, groups, cfg, seed=0, micro_batches=MICRO_BATCHES)
    optimizer = plan.build_optimizer(OmegaConf.create({"_component_": "torch.optim.AdamW"}))
    per_rank = batch // groups.dp_size
    g = torch.Generator().manual_seed(groups.dp_rank)
    ids = torch.randint(0, FIELDS["vocab_size"], (per_rank, seq + 1), generator=g)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    extra = {}
    if plan.context is not None:
        inputs, labels = plan.context.split(inputs), plan.context.split(labels)
        extra["context"] = plan.context
    loss_fn = CrossEntropyLoss()
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()
        try:
            saved[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # FSDP2's gathered weights (freed after forward): not activations
            pass
        return tensor

    times = []
    for step in range(steps + 2):  # two warm-up steps
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if plan.pipeline is None:
                loss, _ = loss_fn(plan.model, inputs, labels, **extra)
                (loss / labels.numel()).backward()
            else:  # what the stages keep at once, over the schedule's micro-batches
                scale = torch.tensor(plan.gradient_ranks / (labels.numel() * groups.dp_size))
                plan.pipeline.step(TokenBatch(inputs, labels), loss_fn, scale)
        optimizer.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
    state = sum(local_bytes(p) + local_bytes(p.grad) for p in plan.model.parameters())
    state += sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor))  # fmt: skip
    write_result({"state": state, "saved": sum(saved.values()), "step": statistics.median(times)})
    from torch import distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker", nargs=5, type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker[:3], args.steps, *args.worker[3:])
        return
    for (batch, seq), layouts in SCENARIOS.items():
        results = {}
        for name in layouts:
            shape = [str(n) for n in (*LAYOUTS[name], batch, seq)]
            results[name] = launch(
                Path(__file__), 4, "--worker", *shape, "--steps", str(args.steps)
            )
        base = results[layouts[0]]
        rows = [[name, f"{r['state'] / MIB:.1f}", f"{r['state'] / base['state']:.2f}",
                 f"{r['saved'] / MIB:.1f}", f"{r['saved'] / base['saved']:.2f}",
                 f"{r['step']:.3f}", f"{r['step'] / base['step']:.2f}"]
                for name, r in results.items()]  # fmt: skip
        print(f"\ndecoder {FIELDS['hidden_dim']} x {FIELDS['num_layers']} blocks, global batch "
              f"{batch} x {seq} tokens, 4 gloo processes, rank 0 (MiB, s)")  # fmt: skip
        print(table(rows, ["layout", "state", "ratio", "saved for backward", "ratio", "step s",
                           "ratio"]))  # fmt: skip


if __name__ == "__main__":
    main()

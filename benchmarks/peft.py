"""LoRA / QLoRA vs full fine-tuning: memory per rank and step time, side by side.

On llm/small's decoder (52M parameters), 2 processes, FSDP2, AdamW, one run each:
- state per rank: this rank's parameters + gradients + optimizer state after a
  step (exact accounting of the tensors it holds), all of them and the trainable
  part only;
- QLoRA: the bytes of the NF4 base weights vs the same weights in bf16;
- step time: median of 8 steps (forward, backward, optimizer) after 2 warm-up steps.
Then an analytic table for Llama-3.1-8B on 8 GPUs (model states only: weights,
gradients, AdamW), beside torchtune's published peak memory for Llama-2-7B.

    python benchmarks/peft.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import launch, local_bytes, table, write_result  # noqa: E402

METHODS = ("full", "lora", "qlora", "lora_bf16")
MIB = 2**20


def worker(method: str) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from freetx.distributed import DistributedConfig, build_groups, init_distributed, parallelize
    from freetx.models.peft import PEFTConfig, apply_peft
    from freetx.models.transformer import decoder

    runtime = init_distributed("cpu")
    with torch.device("meta"):
        model = decoder("small", max_seq_len=128)
    if method != "full":
        cfg = PEFTConfig(method="lora", rank=16, alpha=32,
                         quantize_base="nf4" if method == "qlora" else "none")  # fmt: skip
        apply_peft(model, cfg, runtime.world_size)
    distributed = DistributedConfig()
    if method.endswith("bf16"):  # bf16 compute: the frozen base is stored in bf16 too
        distributed.mixed_precision.param_dtype = "bfloat16"
    plan = parallelize(
        model,
        build_groups(runtime, OmegaConf.structured(distributed)),
        OmegaConf.structured(distributed),
        seed=0,
    )
    optimizer = plan.build_optimizer(
        OmegaConf.create({"_component_": "torch.optim.AdamW", "lr": 1e-4})
    )
    x = torch.randint(0, 259, (4, 128), generator=torch.Generator().manual_seed(runtime.rank))
    times = []
    for step in range(10):
        start = time.perf_counter()
        plan.model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        dist.barrier()
        if step >= 2:
            times.append(time.perf_counter() - start)
    params = list(plan.model.parameters())
    trainable = [p for p in params if p.requires_grad]
    opt_state = sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
                    if torch.is_tensor(v))  # fmt: skip
    grads = sum(local_bytes(p.grad) for p in trainable)
    all_params = sum(local_bytes(p) for p in params)
    trainable_params = sum(local_bytes(p) for p in trainable)
    frozen = [p for p in params if not p.requires_grad]
    nf4 = sum(local_bytes(p) for p in frozen if "NF4" in type(p._local_tensor).__name__) \
        if method == "qlora" else 0  # fmt: skip
    nf4_as_bf16 = sum(p._local_tensor.numel() * 2 for p in frozen
                      if "NF4" in type(p._local_tensor).__name__) if method == "qlora" else 0  # fmt: skip
    values = torch.tensor([all_params + grads + opt_state, trainable_params + grads + opt_state,
                           nf4, nf4_as_bf16, statistics.median(times)], dtype=torch.float64)  # fmt: skip
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    write_result(dict(zip(("state", "trainable_state", "nf4", "nf4_as_bf16", "step_s"),
                          values.tolist())))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def llama8b_model_states(gpus: int = 8) -> list[list[str]]:
    """Weights + grads + AdamW per GPU under FSDP (bytes / gpus), Llama-3.1-8B, LoRA r=16
    on the 7 projections: 32 layers x (q 4096x4096, k/v 1024x4096, o, gate/up/down 14336)."""
    base = 8.03e9
    per_layer = 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3)
    adapters = 32 * per_layer
    rows = []
    for name, frozen_bytes, trainable in (
        ("full (fp32 master, AdamW)", 0, base),
        ("LoRA r=16, bf16 compute (bf16 base)", 2 * base, adapters),
        ("QLoRA r=16, NF4 base", 0.516 * base, adapters),
    ):
        state = frozen_bytes + trainable * (4 + 4 + 8)  # fp32 weight, grad, two moments
        rows.append([name, f"{trainable / 1e6:,.1f}M", f"{state / gpus / 2**30:.2f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    results = {m: launch(Path(__file__), 2, "--worker", m) for m in METHODS}
    full = results["full"]
    rows = []
    for method in METHODS:
        r = results[method]
        rows.append([method, f"{r['state'] / MIB:.1f}", f"{r['state'] / full['state']:.3f}",
                     f"{r['trainable_state'] / MIB:.1f}",
                     f"{r['trainable_state'] / full['trainable_state']:.3f}",
                     f"{r['step_s']:.3f}", f"{r['step_s'] / full['step_s']:.2f}"])  # fmt: skip
    print("llm/small's decoder (52M), 2 processes, FSDP2, AdamW; per rank (the larger rank)")
    print(table(rows, ["method", "state MiB", "/ full", "trainable state MiB", "/ full",
                       "step s", "/ full"]))  # fmt: skip
    q = results["qlora"]
    print(f"\nQLoRA base weights per rank: NF4 {q['nf4'] / MIB:.2f} MiB vs bf16 "
          f"{q['nf4_as_bf16'] / MIB:.2f} MiB = {q['nf4'] / q['nf4_as_bf16']:.3f}x (target <= 0.3)")  # fmt: skip
    print("\nLlama-3.1-8B on 8 GPUs, FSDP: model states per GPU (weights + grads + AdamW;")
    print("activations, buffers and allocator overhead come on top)")
    print(table(llama8b_model_states(), ["method", "trainable", "GiB per GPU"]))
    print("\ntorchtune's published peak memory (Llama-2-7B, torch.cuda.max_memory_reserved,")
    print("activations included): QLoRA 1 GPU 9.29 GB; LoRA 2 GPUs 14.17 GB; LoRA 1 GPU")
    print("17.18 GB; full 4 GPUs 12.01 GB (torchtune README, 2024).")


if __name__ == "__main__":
    main()

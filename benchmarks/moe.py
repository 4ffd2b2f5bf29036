"""Mixture-of-experts blocks, side by side in one run.

`--section grouped-mm` (a CUDA GPU, sm90+): one Qwen3-30B-A3B-shaped MoE block (hidden
2048, 128 experts of 768, 8 per token, bf16) over `--tokens` tokens, forward and backward,
with the experts' matmuls as `torch._grouped_mm` (what freetx runs there) and as the
loop over the experts (what it runs elsewhere): median step time over `--repeats`
steps after 3 warm-ups (CUDA events), the allocator's peak, and how far the two outputs
and the w1 gradients are apart (bf16 rounding of different summation orders).

    python benchmarks/moe.py --section grouped-mm [--tokens 8192] [--repeats 20]

`--section paths` (CPU): a family whose folders transformers converts on load (Qwen3-MoE:
experts stored one tensor per expert, held fused), as freetx's native decoder and through
the generic transformers path, by benchmarks/hf_paths.py's measure (training steps in
turn, peak live tensor bytes), at a shape with more, smaller experts than hf_paths' own.

    OMP_NUM_THREADS=1 python benchmarks/moe.py --section paths

`--section ep` (CPU, 4 gloo processes): llm/moe_tiny_ep's decoder with a Qwen3-MoE-shaped
block of more, wider experts (`EP_MODEL`: 32 experts of 512, 4 per token) trained under
fsdp at ep 1 (every rank's FSDP2 shard of every expert), ep 2 and ep 4 (a rank computes
1/ep of each block's experts, tokens sent to them by all-to-all): the median step time
over steps 3..N and the fullest rank's peak RSS, each with its ratio to ep 1, and
`freetx estimate`'s peak per rank for the same runs.

    python benchmarks/moe.py --section ep [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import table  # noqa: E402

GIB = 2**30
# Qwen3-30B-A3B's MoE block (config.json: hidden_size 2048, moe_intermediate_size 768,
# num_experts 128, num_experts_per_tok 8, norm_topk_prob true)
QWEN3_30B_A3B = dict(hidden_dim=2048, ffn_hidden_dim=768, num_experts=128, experts_per_token=8)


def _block(shape: dict, device: str, dtype: torch.dtype, seed: int = 0):
    from freetx.models.moe import MoEFeedForward

    torch.manual_seed(seed)
    block = MoEFeedForward(**shape, norm_topk_prob=True, expert_weights_fp32=False)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return block.to(device=device, dtype=dtype)


def _timed_steps(block, x, grad, repeats: int, device: str) -> tuple[float, float, tuple]:
    """Median seconds of forward + backward, the peak allocated GiB, (output, w1.grad)."""
    times = []
    for i in range(3 + repeats):
        block.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        out, _ = block(x)
        out.backward(grad)
        if device == "cuda":
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            seconds = time.perf_counter() - t0
        if i >= 3:
            times.append(seconds)
    peak = torch.cuda.max_memory_allocated() / GIB if device == "cuda" else float("nan")
    return statistics.median(times), peak, (out.detach().float(), block.experts.w1.grad.float())


def grouped_mm(tokens: int, repeats: int, shape: dict) -> None:
    from freetx.models import moe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    block = _block(shape, device, dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, shape["hidden_dim"], device=device, dtype=dtype, generator=gen)
    grad = torch.randn(x.shape, device=device, dtype=dtype, generator=gen)
    sizes = (shape["ffn_hidden_dim"], shape["hidden_dim"])
    grouped = moe._uses_grouped_mm(x, block.experts.w1) and moe._uses_grouped_mm(
        torch.empty(0, sizes[0], device=device, dtype=dtype), block.experts.w2
    )
    rows, results = [], {}
    kernels = [("grouped_mm", True), ("loop over experts", False)] if grouped else []
    if not grouped:
        print(f"torch._grouped_mm does not run here ({device}, {dtype}): the loop only")
        kernels = [("loop over experts", False)]
    for name, use in kernels:
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        with mock.patch.object(moe, "_uses_grouped_mm", lambda *_, use=use: use):
            results[name] = _timed_steps(block, x, grad, repeats, device)
    base = results[kernels[-1][0]][0]
    for name, (seconds, peak, _) in results.items():
        rows.append([name, f"{seconds * 1000:.2f}", f"{base / seconds:.2f}x", f"{peak:.2f}"])
    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(
        f"one MoE block, {shape['num_experts']} experts of {shape['ffn_hidden_dim']}, "
        f"{shape['experts_per_token']} per token, hidden {shape['hidden_dim']}, {tokens} tokens, "
        f"bf16, forward + backward, median of {repeats} ({device_name}, torch {torch.__version__})"
    )
    print(table(rows, ["kernel", "ms / step", "speed vs loop", "peak GiB"]))
    if len(results) == 2:
        (_, _, (out_a, grad_a)), (_, _, (out_b, grad_b)) = results.values()
        scale = out_b.abs().max().item()
        print(
            f"output max |grouped - loop| = {(out_a - out_b).abs().max().item():.3e} "
            f"(of max |output| {scale:.3e}); w1.grad max diff "
            f"{(grad_a - grad_b).abs().max().item():.3e} (of {grad_b.abs().max().item():.3e})"
        )


# a Qwen3-MoE shaped like Qwen3-30B-A3B's blocks (many small experts, top 8 of 128 there),
# scaled down: 32 experts of 128, top 4
PATHS_SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=512,
                   moe_intermediate_size=128, num_experts=32, num_experts_per_tok=4,
                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=32, max_position_embeddings=512, norm_topk_prob=True)  # fmt: skip


def paths() -> None:
    """benchmarks/hf_paths.py's comparison on PATHS_SHAPE: the two paths' training steps
    in turn in one process, peak live tensor bytes by MemTracker."""
    import transformers

    from benchmarks import hf_paths

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(
        3, PATHS_SHAPE["vocab_size"], (hf_paths.BATCH, hf_paths.SEQ), generator=generator
    )
    with tempfile.TemporaryDirectory() as tmp:
        config = transformers.Qwen3MoeConfig(**PATHS_SHAPE)
        config.save_pretrained(tmp)
        built = {"native": hf_paths.native(Path(tmp)), "generic": hf_paths.generic(config)}
    times = hf_paths.step_times([model for model, _ in built.values()], ids)
    rows, figures = [], {}
    for (path, (model, what)), spent in zip(built.items(), times):
        figures[path] = (statistics.median(spent), hf_paths.peak_mib(model, ids))
        median, peak = figures[path]
        rows.append([path, what, f"{median:.0f}", f"{peak:.0f}"])
    rows.append(["generic / native", "", *(f"{g / n:.2f}" for n, g in zip(*figures.values()))])
    shape = PATHS_SHAPE
    print(
        f"Qwen3-MoE: {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
        f"{shape['num_experts']} experts of {shape['moe_intermediate_size']}, top "
        f"{shape['num_experts_per_tok']}; training step (forward + backward + AdamW), batch "
        f"{hf_paths.BATCH} x {hf_paths.SEQ}, fp32, 1 thread; the paths' steps in turn, "
        f"{hf_paths.STEPS} each after {hf_paths.WARMUP}"
    )
    print(table(rows, ["path", "model", "median ms", "peak MiB"]))


EP_MODEL = ["model.num_experts=32", "model.experts_per_token=4", "model.moe_ffn_hidden_dim=512",
            "batch_size=16", "eval.max_batches=1", "checkpoint.save_final=false",
            "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"]  # fmt: skip


def expert_parallel(steps: int) -> None:
    import json

    from benchmarks.common import freetx, measured_run

    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for ep in (1, 2, 4):
            out = Path(tmp) / f"ep{ep}"
            overrides = [*EP_MODEL, f"distributed.ep={ep}"]
            run = measured_run("llm/moe_tiny_ep", overrides, steps, 4, out)
            path = out / "estimate.json"
            freetx("estimate", "llm/moe_tiny_ep", *overrides, "--world-size", "4", "--device",
                   "cpu", "--json", str(path), "--overwrite")  # fmt: skip
            estimate = json.loads(path.read_text())["analytic"]["fsdp"]["peak"]
            base = base or (run, estimate)
            rows.append([f"ep {ep}", f"{run['step_s']:.3f} ({run['step_s'] / base[0]['step_s']:.2f}x)",
                         f"{run['rss'] / GIB:.3f} ({run['rss'] / base[0]['rss']:.2f}x)",
                         f"{estimate / 2**20:.1f} ({estimate / base[1]:.2f}x)"])  # fmt: skip
    print(
        f"llm/moe_tiny_ep with {' '.join(EP_MODEL[:3])}, fsdp on 4 CPU processes, fp32, "
        f"{steps} steps (median over steps 3..{steps}, one thread per process)"
    )
    print(table(rows, ["layout", "step s", "max RSS GiB/rank", "estimate MiB/rank"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=["grouped-mm", "paths", "ep"], required=True)
    parser.add_argument("--steps", type=int, default=8, help="ep: training steps per run")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="a 16x smaller block (a dry run)")
    args = parser.parse_args()
    shape = dict(QWEN3_30B_A3B)
    if args.small:
        shape.update(hidden_dim=128, ffn_hidden_dim=48, num_experts=16)
    if args.section == "grouped-mm":
        grouped_mm(args.tokens, args.repeats, shape)
    elif args.section == "paths":
        paths()
    else:
        expert_parallel(args.steps)


if __name__ == "__main__":
    main()

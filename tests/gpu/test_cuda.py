"""The CUDA paths, through the CLI on one GPU: bf16 training with CUDA memory stats, the
FSDP2 path on NCCL (a world of one with CPU offload), float16 and its loss scaler, QLoRA's
NF4 base, per-block compile, the profiler's memory timeline, `freetx estimate --measure` against the
allocator's peak, and the generation engine's compiled step with CUDA graphs. Skipped where there is no GPU (CI, the 2-core dev machine); run them
on a GPU machine with `pytest tests/gpu`."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_freetx

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TINY = ["full_finetune_fsdp2", "--config", "llm/tiny", "device=cuda", "eval.max_batches=2",
        "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"]  # fmt: skip


def records(output_dir):
    return [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]


def train_records(output_dir):
    return [r for r in records(output_dir) if "loss" in r]


def run_ok(*args):
    result = run_freetx(*args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_bf16_training_logs_cuda_memory_and_resumes(tmp_path):
    out = tmp_path / "bf16"
    run_ok("run", *TINY, f"output_dir={out}", "max_steps=30", "log_every_n_steps=5",
           "distributed.mixed_precision.param_dtype=bfloat16", "checkpoint.every_n_steps=15")  # fmt: skip
    steps = train_records(out)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    assert 0 < steps[-1]["memory/peak_allocated_gib"] <= steps[-1]["memory/peak_reserved_gib"]
    assert "mfu_pct" in steps[-1]  # the H100's peak is in the table
    result = run_ok("run", *TINY, f"output_dir={out}", "max_steps=40", "log_every_n_steps=5",
                    "distributed.mixed_precision.param_dtype=bfloat16")  # fmt: skip
    assert "(step 30," in result.stdout
    assert train_records(out)[-1]["step"] == 40


def test_fsdp2_on_nccl_with_cpu_offload(tmp_path):
    out = tmp_path / "offload"
    result = run_ok("run", "--nproc-per-node", "1", *TINY, f"output_dir={out}", "max_steps=10",
                    "log_every_n_steps=5", "distributed.cpu_offload=true",
                    "distributed.mixed_precision.param_dtype=bfloat16")  # fmt: skip
    assert "nccl" in result.stdout
    steps = train_records(out)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)


@pytest.mark.parametrize("offload", [False, True], ids=["fsdp", "fsdp-cpu-offload"])
def test_float16_with_fsdp_trains_and_resumes(tmp_path, offload):
    """float16 (V100/T4 have no bfloat16) with fsdp on 1 process: the plain model under
    autocast; with CPU offload FSDP2 on NCCL, the gradients on the CPU and the scale on
    the GPU (the scaler's two devices). The scale is saved and resumed."""
    out = tmp_path / "fp16"
    options = [f"output_dir={out}", "log_every_n_steps=5", "distributed.strategy=fsdp",
               "distributed.mixed_precision.param_dtype=float16",
               f"distributed.cpu_offload={str(offload).lower()}"]  # fmt: skip
    run_ok("run", "--nproc-per-node", "1", *TINY, *options, "max_steps=20")
    result = run_ok("run", "--nproc-per-node", "1", *TINY, *options, "max_steps=30")
    assert "(step 20," in result.stdout
    steps = train_records(out)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5


def test_per_block_compile(tmp_path):
    out = tmp_path / "compile"
    run_ok("run", *TINY, f"output_dir={out}", "max_steps=20", "log_every_n_steps=10",
           "distributed.compile=true", "distributed.mixed_precision.param_dtype=bfloat16")  # fmt: skip
    steps = train_records(out)
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_qlora_nf4_base(tmp_path):
    base = tmp_path / "base"
    run_ok("run", *TINY, f"output_dir={base}", "max_steps=20", "checkpoint.every_n_steps=0")
    out = tmp_path / "qlora"
    run_ok("run", "lora_finetune_fsdp2", "--config", "llm/qlora_tiny", "device=cuda",
           f"model_dir={base}", f"output_dir={out}", "max_steps=20", "log_every_n_steps=10",
           "eval.max_batches=2", "distributed.mixed_precision.param_dtype=bfloat16",
           "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]")  # fmt: skip
    steps = train_records(out)
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_profiler_writes_a_trace_and_memory_timeline(tmp_path):
    out = tmp_path / "profile"
    run_ok("run", *TINY, f"output_dir={out}", "max_steps=6", "profiler.enabled=true",
           "profiler.wait=1", "profiler.warmup=1", "profiler.active=2",
           "profiler.profile_memory=true")  # fmt: skip
    traces = list((out / "profile").glob("rank0_step*.json"))
    assert traces and "traceEvents" in json.loads(traces[0].read_text())
    assert "cuda" in next((out / "profile").glob("rank0_*_ops.txt")).read_text().lower()
    assert list((out / "profile").glob("rank0_*_memory.*"))


def test_estimate_matches_the_allocator(tmp_path):
    """llm/small (52M) on one GPU, bf16: the analytic and the measured (fake tensors, CUDA
    kernels) peaks against the real step's peak allocated, same shape."""
    shape = ["batch_size=8", "distributed.mixed_precision.param_dtype=bfloat16"]
    result = run_ok("estimate", "llm/small", *shape, "--world-size", "1", "--measure",
                    "--json", str(tmp_path / "estimate.json"))  # fmt: skip
    figures = json.loads((tmp_path / "estimate.json").read_text())
    out = tmp_path / "real"
    run_ok("run", "full_finetune_fsdp2", "--config", "llm/small", "device=cuda", *shape,
           f"output_dir={out}", "max_steps=3", "log_every_n_steps=1", "eval.max_batches=1",
           "checkpoint.every_n_steps=0", "checkpoint.save_final=false",
           "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]")  # fmt: skip
    real = train_records(out)[-1]["memory/peak_allocated_gib"] * 2**30
    fake = figures["measured"]["fsdp"]["peak"]
    analytic = figures["analytic"]["fsdp"]["peak"]
    print(result.stdout, f"real {real / 2**20:.0f} MiB, measured {fake / 2**20:.0f} MiB, "
          f"analytic {analytic / 2**20:.0f} MiB")  # fmt: skip
    assert abs(fake - real) / real < 0.15
    assert abs(analytic - real) / real < 0.15


def test_a_chunked_loss_in_bf16_matches_the_unchunked_and_holds_less():
    """CrossEntropyLoss(num_chunks=8) at a 128k vocabulary on one GPU, bf16 compute: the
    loss and the head's gradient within bf16's rounding of the unchunked ones, and a
    lower allocator peak."""
    from freetx.distributed import materialize
    from freetx.models.transformer import decoder
    from freetx.objectives import CrossEntropyLoss

    with torch.device("meta"):
        model = decoder(vocab_size=128_256, hidden_dim=256, num_layers=2, num_heads=4,
                        num_kv_heads=2, ffn_hidden_dim=768, max_seq_len=4096)  # fmt: skip
    materialize(model, torch.device("cuda"), seed=0)
    ids = torch.randint(0, 128_256, (2, 4097), device="cuda")
    results = {}
    for chunks in (1, 8):
        model.zero_grad(set_to_none=True)
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = CrossEntropyLoss(num_chunks=chunks)(model, ids[:, :-1], ids[:, 1:])
        loss.backward()
        peak = torch.cuda.max_memory_allocated()
        results[chunks] = (loss.item(), model.tok_embeddings.weight.grad.float().clone(), peak)
    (whole, whole_grad, whole_peak), (loss, grad, peak) = results[1], results[8]
    assert abs(loss - whole) <= 1e-2 * abs(whole)
    assert (grad - whole_grad).norm() <= 2e-2 * whole_grad.norm()
    assert peak < 0.7 * whole_peak


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_context_parallel_queries_on_compiled_flex_attention(packed):
    """What a context-parallel rank computes on CUDA: its load-balanced queries over the
    whole sequence's keys through compiled FlexAttention with a block mask built from
    its positions (and a packed batch's documents), against the same rows of the whole
    sequence's attention (SDPA with the dense mask), for each of 4 ranks; a window and
    grouped keys."""
    from freetx.distributed.context_parallel import balanced_indices
    from freetx.models.attention import AttentionSpec, attend, context_mask, document_mask

    spec, length = AttentionSpec(window=300), 1024
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, h, length, 64, device="cuda", generator=generator)
               for h in (8, 2, 2))  # fmt: skip
    documents = None
    if packed:
        documents = torch.zeros(2, length, dtype=torch.long, device="cuda")
        documents[:, 400:], documents[0, 700:], documents[1, 1000:] = 1, 2, -1
        whole = attend(q, k, v, spec, mask=document_mask(documents, spec, kernel="sdpa_mask"))
    else:
        whole = attend(q, k, v, spec, kernel="sdpa_mask")
    for rank in range(4):
        mine = balanced_indices(length, 4, rank, device="cuda")
        mask = context_mask(mine, length, spec, documents)
        assert mask.kernel == "flex"
        rows = attend(q[:, :, mine], k, v, spec, mask=mask)
        assert (rows - whole[:, :, mine]).abs().max() <= 2e-3, rank


def offloading_run(model, ids, offload: bool):
    """One forward and backward of `model` on `ids` (fp32), with or without activation
    offloading: the loss, the gradients, the allocator's peak above the model."""
    from contextlib import nullcontext

    from freetx.distributed.activation_offload import OffloadActivations

    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    hooks = OffloadActivations(torch.device("cuda"), keep=model.buffers()) if offload else None
    with hooks or nullcontext():
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    del logits
    loss.backward()
    torch.cuda.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    return loss.item(), grads, torch.cuda.max_memory_allocated() - base


def test_activation_offloading_on_cuda_equals_and_holds_less():
    """A 8-block decoder, 8 x 1024 tokens, fp32: with saved activations offloaded to
    pinned host memory (side stream, prefetched), the same loss, the gradients within
    the attention backward's nondeterminism, and a lower allocator peak."""
    from freetx.distributed import materialize
    from freetx.models.transformer import decoder

    with torch.device("meta"):
        model = decoder(vocab_size=259, hidden_dim=512, num_layers=8, num_heads=8,
                        num_kv_heads=4, ffn_hidden_dim=1408, max_seq_len=1024)  # fmt: skip
    materialize(model, torch.device("cuda"), seed=0)
    generator = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 259, (8, 1025), device="cuda", generator=generator)
    offloading_run(model, ids, offload=True)  # warm-up: kernels, the pinned host pool
    loss, grads, peak = offloading_run(model, ids, offload=False)
    offloaded_loss, offloaded_grads, offloaded_peak = offloading_run(model, ids, offload=True)
    print(f"peak above the model: {peak / 2**20:.0f} MiB without, "
          f"{offloaded_peak / 2**20:.0f} MiB with activation offloading")  # fmt: skip
    assert abs(offloaded_loss - loss) <= 1e-6 * loss  # the same kernels on the same data
    for grad, offloaded in zip(grads, offloaded_grads, strict=True):
        torch.testing.assert_close(offloaded, grad, rtol=1e-4, atol=1e-6)
    assert offloaded_peak < 0.6 * peak


def test_activation_offloading_through_the_recipe_with_checkpointing(tmp_path):
    """llm/tiny in bf16 with full activation checkpointing: the losses with the
    blocks' inputs offloaded equal those without, within bf16's run-to-run noise."""
    losses = {}
    for offloading in ("false", "true"):
        out = tmp_path / offloading
        run_ok("run", *TINY, f"output_dir={out}", "max_steps=10", "log_every_n_steps=1",
               "checkpoint.every_n_steps=0", "checkpoint.save_final=false",
               "distributed.mixed_precision.param_dtype=bfloat16",
               "distributed.activation_checkpointing=full",
               f"distributed.activation_offloading={offloading}")  # fmt: skip
        losses[offloading] = [r["loss"] for r in train_records(out)]
    assert len(losses["true"]) == 10
    for with_it, without in zip(losses["true"], losses["false"], strict=True):
        assert abs(with_it - without) <= 1e-2 * without


needs_float8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="float8 matmuls need CUDA capability 8.9+",
)


def float8_losses(recipe: str, steps: int = 10) -> list[float]:
    """`steps` AdamW steps of a 2-block decoder (d 256) under bf16 autocast, its blocks'
    Linears in float8 by `recipe` (none: bf16), on the same batches."""
    from freetx.distributed import materialize
    from freetx.distributed.float8 import convert_to_float8
    from freetx.models.transformer import decoder

    with torch.device("meta"):
        model = decoder(vocab_size=259, hidden_dim=256, num_layers=2, num_heads=4,
                        num_kv_heads=2, ffn_hidden_dim=768, max_seq_len=512)  # fmt: skip
    if recipe != "none":
        convert_to_float8(model, recipe, float8_all_gather=False)
    materialize(model, torch.device("cuda"), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator(device="cuda").manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 259, (8, 257), device="cuda", generator=generator)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@needs_float8
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_trains_like_bf16(recipe):
    """10 steps: each float8 loss within 2% of bf16's (torchao publishes no loss
    tolerance; its tests compare float8 linears to high precision by SQNR)."""
    reference, float8 = float8_losses("none"), float8_losses(recipe)
    print(recipe, [f"{a:.4f}/{b:.4f}" for a, b in zip(float8, reference)])
    for got, expected in zip(float8, reference, strict=True):
        assert abs(got - expected) <= 0.02 * expected


@needs_float8
def test_float8_all_gather_under_fsdp2_at_one_process(tmp_path):
    """The FSDP2 path of distributed.float8=tensorwise on a 1-rank NCCL mesh: the
    converted weights stay float8-cast wrappers through `materialize`, their scales are
    precomputed after each step, and the losses follow float8 without all-gather."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from freetx.distributed import materialize
    from freetx.distributed.float8 import convert_to_float8, precompute_float8_scales
    from freetx.models.transformer import decoder

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        with torch.device("meta"):
            model = decoder(vocab_size=259, hidden_dim=256, num_layers=2, num_heads=4,
                            num_kv_heads=2, ffn_hidden_dim=768, max_seq_len=512)  # fmt: skip
        convert_to_float8(model, "tensorwise", float8_all_gather=True)
        mesh = init_device_mesh("cuda", (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        materialize(model, torch.device("cuda"), seed=0)
        weight = model.layers[0].feed_forward.w1.weight
        assert type(weight.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor"
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator(device="cuda").manual_seed(0)
        losses = []
        for _ in range(10):
            ids = torch.randint(0, 259, (8, 257), device="cuda", generator=generator)
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), ids[:, 1:].flatten()
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            precompute_float8_scales(model)
            losses.append(loss.item())
    finally:
        dist.destroy_process_group()
    reference = float8_losses("tensorwise")
    for got, expected in zip(losses, reference, strict=True):
        assert abs(got - expected) <= 0.02 * expected


@needs_float8
def test_float8_through_the_recipe(tmp_path):
    """llm/tiny with distributed.float8=tensorwise in bf16, 1 process: trains, within 2%
    of bf16's losses."""
    losses = {}
    for recipe in ("none", "tensorwise"):
        out = tmp_path / recipe
        run_ok("run", *TINY, f"output_dir={out}", "max_steps=10", "log_every_n_steps=5",
               "checkpoint.every_n_steps=0", "distributed.mixed_precision.param_dtype=bfloat16",
               f"distributed.float8={recipe}")  # fmt: skip
        losses[recipe] = [r["loss"] for r in train_records(out)]
    for got, expected in zip(losses["tensorwise"], losses["none"], strict=True):
        assert abs(got - expected) <= 0.02 * expected


@pytest.mark.parametrize("rung", ["optimizer.offload=cpu", "optimizer.in_backward=true"])
def test_an_optimizer_rung_on_cuda_trains_as_the_ordinary_optimizer_and_holds_less(tmp_path, rung):
    """fp32 on one GPU: the same losses (the offloaded step runs on the CPU: AdamW's CPU
    and CUDA kernels round alike in fp32 to ~1e-6), and a lower allocator peak (offload:
    no AdamW states on the device; in_backward: no step holds every gradient)."""
    common = ["max_steps=6", "log_every_n_steps=1", "max_grad_norm=null",
              "model.dropout=0.0"]  # fmt: skip
    run_ok("run", *TINY, f"output_dir={tmp_path / 'plain'}", *common)
    run_ok("run", *TINY, f"output_dir={tmp_path / 'rung'}", *common, rung)
    plain, rung_run = train_records(tmp_path / "plain"), train_records(tmp_path / "rung")
    for a, b in zip(plain, rung_run):
        assert abs(a["loss"] - b["loss"]) <= 1e-4, (a["step"], a["loss"], b["loss"])
    peak = "memory/peak_allocated_gib"
    assert rung_run[-1][peak] < plain[-1][peak]


def test_the_generation_engine_on_cuda_compiled_with_cuda_graphs_gives_the_eager_tokens():
    """The engine's CUDA path: static shapes and CUDA graphs (`compile` None on CUDA) give
    the eager step's tokens, and the static batch's, in fp32; in bf16 under autocast the
    pool holds bf16 entries and every row ends."""
    from freetx.models.engine import EngineConfig
    from freetx.models.generation import Draws, Sampling, generate
    from freetx.models.transformer import decoder

    torch.manual_seed(0)
    model = decoder(preset="tiny", vocab_size=64, max_seq_len=128).cuda().eval()
    prompts = [[1, *range(5, 5 + n)] for n in (3, 9, 17, 30)]
    rows = [p for p in prompts for _ in range(4)]
    draws = Draws.keyed([f"row {i}" for i in range(len(rows))], 40)
    sampling, ends = Sampling(1.0), [3, 4]
    eager = generate(model, rows, 40, sampling, ends, draws, engine=EngineConfig(compile=False))
    graphs = generate(model, rows, 40, sampling, ends, draws, engine=EngineConfig(slots=8))
    static = generate(model, rows, 40, sampling, ends, draws, engine=EngineConfig(paged=False))
    assert graphs.replies() == eager.replies() == static.replies()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = generate(model, rows, 40, sampling, ends, draws)
    assert out.stats.block_bytes == 16 * 4 * 2 * 2 * 32 * 2  # bf16 keys and values

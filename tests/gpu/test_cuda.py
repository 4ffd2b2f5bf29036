"""The CUDA paths, through the CLI on one GPU: bf16 training with CUDA memory stats, the
FSDP2 path on NCCL (a world of one with CPU offload), float16 and its loss scaler, QLoRA's
NF4 base, per-block compile, the profiler's memory timeline, and `freetx estimate --measure` against the
allocator's peak. Skipped where there is no GPU (CI, the 2-core dev machine); run them
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
    from freetx.training import CrossEntropyLoss

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

"""The mixture-of-experts decoder (freetx.models.moe): routing and expert sums, the
load-balancing loss as transformers computes it, how it reaches the training loss,
parameter counts, and what the HF layouts refuse."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from freetx.distributed import materialize
from freetx.errors import CheckpointError, ConfigError
from freetx.models.moe import MoEFeedForward, grouped_mm_fits
from freetx.models.protocol import LMOutput
from freetx.models.transformer import decoder
from freetx.objectives import CrossEntropyLoss
from tests.conftest import one_paragraph, run_freetx

MOE = dict(vocab_size=64, hidden_dim=32, num_layers=3, num_heads=4, num_kv_heads=2,
           ffn_hidden_dim=48, moe_ffn_hidden_dim=24, max_seq_len=32, num_experts=4,
           experts_per_token=2, router_aux_loss_coef=0.05, mlp_only_layers=[1])  # fmt: skip


def moe_model(**fields):
    with torch.device("meta"):
        model = decoder(**{**MOE, **fields})
    materialize(model, torch.device("cpu"), seed=3)
    return model


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("expert_weights_fp32", [True, False])
def test_the_expert_loop_sums_each_tokens_k_experts_by_their_router_weights(
    norm_topk_prob, expert_weights_fp32
):
    torch.manual_seed(0)
    layer = MoEFeedForward(16, 24, 4, 2, norm_topk_prob, expert_weights_fp32)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 5, 16)
    out, routing = layer(x)
    flat = x.reshape(-1, 16)
    probs = F.softmax(layer.gate(flat), dim=-1)
    expected = torch.zeros_like(flat)
    chosen_count = torch.zeros(4)
    for t, row in enumerate(flat):
        weights, experts = probs[t].topk(2)
        if norm_topk_prob:
            weights = weights / weights.sum()
        for w, e in zip(weights, experts):
            w1, w3, w2 = (layer.experts.w1[e], layer.experts.w3[e], layer.experts.w2[e])
            expected[t] += w * (w2 @ (F.silu(w1 @ row) * (w3 @ row)))
            chosen_count[e] += 1
    assert (out.reshape(-1, 16) - expected).abs().max() < 1e-5
    assert torch.equal(routing.counts, chosen_count)
    assert len(set(chosen_count.nonzero().flatten().tolist())) > 2  # several experts used
    assert (routing.probs - probs.sum(0)).abs().max() < 1e-5 and routing.tokens == 15


def test_grouped_mm_is_chosen_only_where_its_kernel_runs():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert grouped_mm_fits("cuda", bf16, (9, 0), (64, 128))
    assert grouped_mm_fits("cuda", bf16, (10, 0), (64, 128))
    assert not grouped_mm_fits("cuda", bf16, (8, 0), (64, 128))  # A100: the loop
    assert not grouped_mm_fits("cuda", fp32, (9, 0), (64, 128))
    assert not grouped_mm_fits("cuda", bf16, (9, 0), (64, 20))  # rows not 16-byte aligned
    assert grouped_mm_fits("cpu", fp32, None, (64, 20))  # torch's CPU kernel
    assert not grouped_mm_fits("cpu", fp32, None, (64, 2))  # rows of 8 bytes (a LoRA rank 2)
    assert grouped_mm_fits("cpu", bf16, None, (64, 128))
    assert not grouped_mm_fits("cpu", torch.float64, None, (64, 128))


def test_the_grouped_mm_path_computes_what_the_loop_does(monkeypatch):
    """torch's grouped matmul has a CPU kernel (torch 2.10+), which the CPU runs: its call
    (weights transposed, int32 offsets) is checked here, forward and backward, against the
    loop: the same sums exactly, also with an expert no token chose and a gradient that
    is a broadcast (the sum's: strides 0, which the kernel's backward refuses as such)."""
    import freetx.models.moe as moe

    torch.manual_seed(0)
    layer = MoEFeedForward(16, 24, 4, 2, True, True)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 5, 16)
    results = []
    for grouped in (False, True):
        monkeypatch.setattr(moe, "_uses_grouped_mm", lambda _x, _w, g=grouped: g)
        layer.zero_grad()
        out, routing = layer(x)
        out.square().sum().backward()
        results.append((out, [p.grad.clone() for p in layer.parameters()]))
    (loop, loop_grads), (grouped, grouped_grads) = results
    assert torch.equal(loop, grouped)
    assert all(torch.equal(a, b) for a, b in zip(loop_grads, grouped_grads))
    sums = []
    for grouped in (False, True):
        monkeypatch.setattr(moe, "_uses_grouped_mm", lambda _x, _w, g=grouped: g)
        weight = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(0)).requires_grad_()
        rows = torch.randn(6, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
        out = moe.grouped_linear(rows, weight, [2, 0, 3, 1])  # expert 1: no rows
        out.sum().backward()  # a broadcast gradient
        sums.append((out, weight.grad, rows.grad))
    assert all(torch.equal(a, b) for a, b in zip(*sums))
    assert torch.equal(sums[1][1][1], torch.zeros(8, 16))


def test_aux_loss_equals_transformers_load_balancing_loss_on_the_same_router_logits():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = moe_model().train()
    logits = []
    hooks = [
        m.gate.register_forward_hook(lambda _m, _i, out: logits.append(out.detach()))
        for m in model.modules()
        if isinstance(m, MoEFeedForward)
    ]
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    output = model(ids)
    for hook in hooks:
        hook.remove()
    assert isinstance(output, LMOutput) and len(logits) == 2  # layer 1 is dense
    theirs = load_balancing_loss_func(tuple(logits), num_experts=4, top_k=2)
    assert abs(output.metrics["aux_loss"].item() - theirs.item()) < 1e-6
    assert abs(output.aux_loss.item() - 0.05 * theirs.item()) < 1e-7
    assert output.metrics["expert_load_max"] >= 1.0
    assert not isinstance(model.eval()(ids), LMOutput)  # evaluation and sampling: logits


def test_the_loss_adds_the_aux_loss_once_per_loss_token_and_logs_it():
    model = moe_model().train()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :6] = -100
    output = model(ids)
    loss, extras = CrossEntropyLoss()(model, ids, labels)
    ce = F.cross_entropy(output.logits.flatten(0, 1), labels.flatten(), reduction="sum")
    tokens = 26
    assert abs(loss.item() - (ce.item() + tokens * output.aux_loss.item())) < 1e-4
    assert abs(extras["aux_loss"].item() - tokens * output.metrics["aux_loss"].item()) < 1e-4
    loss.backward()
    assert model.layers[0].feed_forward.gate.weight.grad.abs().sum() > 0


def test_active_parameters_count_k_of_e_experts_and_flops_follow_them():
    with torch.device("meta"):
        model = decoder(**MOE)
        dense = decoder(**{**MOE, "num_experts": 0})
    experts_per_layer = 3 * 4 * 24 * 32
    total = model.num_parameters()
    assert model.num_active_parameters() == total - 2 * experts_per_layer // 2
    assert dense.num_active_parameters() == dense.num_parameters()
    per_token = 6 * (model.num_active_parameters() - 64 * 32)
    assert model.flops_per_token(16) == per_token + 12 * 3 * 4 * 8 * 16


def test_lora_on_experts_is_refused_naming_the_fix():
    from freetx.models.peft import apply_lora

    with torch.device("meta"):
        model = decoder(**MOE)
    with pytest.raises(ConfigError, match=r"grouped tensor of all experts.*target_modules=\[q"):
        apply_lora(model, ["q", "gate"], rank=2, alpha=4)
    with torch.device("meta"):
        model = decoder(**MOE)
    assert apply_lora(model, ["q", "v"], rank=2, alpha=4)  # attention of an MoE model


def test_experts_are_not_exported_as_a_dense_type_nor_a_dense_model_as_moe():
    from freetx.models.transformer_hf import LLAMA_LAYOUT

    with torch.device("meta"):
        config = decoder(**{**MOE, "mlp_only_layers": []}).config.__dict__
    with pytest.raises(CheckpointError, match="has no experts.*mixtral or qwen3_moe"):
        LLAMA_LAYOUT.to_hf_config({**config, "hf_model_type": "llama"}, "float32")
    hf = LLAMA_LAYOUT.to_hf_config({**config, "hf_model_type": "mixtral"}, "float32")
    assert (hf["num_local_experts"], hf["num_experts_per_tok"], hf["intermediate_size"]) == (
        4, 2, 24,
    )  # fmt: skip
    with pytest.raises(CheckpointError, match="Export it as mixtral "):
        LLAMA_LAYOUT.to_hf_config({**config, "hf_model_type": "qwen3_moe"}, "float32")
    qwen = {**config, "qk_norm": "head", "hf_model_type": "qwen3_moe"}
    with pytest.raises(CheckpointError, match='"expert_weights_fp32": false'):
        LLAMA_LAYOUT.to_hf_config(qwen, "float32")
    assert LLAMA_LAYOUT.to_hf_config({**qwen, "expert_weights_fp32": False}, "float32")
    with pytest.raises(CheckpointError, match="has experts; this one has num_experts=0"):
        LLAMA_LAYOUT.to_hf_config(
            {**config, "num_experts": 0, "hf_model_type": "mixtral"}, "float32"
        )


def test_a_folder_with_router_noise_is_refused_by_name(tmp_path):
    from tests.hf_folders import make_folder

    folder = make_folder(tmp_path / "m", "mixtral")
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "router_jitter_noise": 0.1}))
    result = run_freetx("checkpoint", "convert", str(folder), str(tmp_path / "dcp"), "--to", "dcp")
    message = one_paragraph(result)
    assert "router_jitter_noise=0.1" in message and "Set it to 0.0" in message
    assert not (tmp_path / "dcp").exists()


def test_a_folder_missing_one_experts_tensor_is_refused_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    from tests.hf_folders import make_folder

    folder = make_folder(tmp_path / "m", "mixtral")
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    gone = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    shard = folder / index["weight_map"].pop(gone)
    tensors = load_file(shard)
    del tensors[gone]
    save_file(tensors, shard, metadata={"format": "pt"})
    index_file.write_text(json.dumps(index))
    result = run_freetx("checkpoint", "convert", str(folder), str(tmp_path / "dcp"), "--to", "dcp")
    assert "lacks slices [2] of layers.1.feed_forward.experts.w3" in one_paragraph(result)


MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
    "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
}  # fmt: skip


def test_estimate_says_total_and_active_parameters_of_mixtral_8x7b(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))  # no weights needed
    result = run_freetx(
        "estimate", "llm/hf_tiny_full", f"model_dir={tmp_path}", "--world-size", "8",
        "--device", "h100", "distributed.mixed_precision.param_dtype=bfloat16",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # Mistral AI's figures: 46.7B parameters, 12.9B active per token
    assert "46.703B parameters (46.703B trained, 12.880B active per token)" in result.stdout


def test_the_free_transformer_refuses_experts():
    from freetx.models.free_transformer import free_transformer

    with pytest.raises(ValueError, match="Set num_experts=0"):
        free_transformer("tiny", num_experts=4)

"""LoRA on MoE experts (freetx.models.peft.experts): per-expert adapters on freetx's grouped
experts (through grouped_linear) and on transformers' experts modules (W + s B A in place of
W), equal to a per-expert loop; a fresh adapter changes nothing; the `experts` and
all-linear targets; PEFT's layout of the factors (target_parameters); merge, estimate, and
what is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from freetx.distributed import materialize
from freetx.errors import ConfigError
from freetx.models.moe import GroupedExperts
from freetx.models.peft import adapters_disabled, apply_lora, merge_adapters
from freetx.models.peft.experts import (
    ExpertLoRA,
    LoRAGroupedExperts,
    adapt_experts,
    merge_expert_adapters,
)
from freetx.models.transformer import decoder

# layer 1 dense (its MLP Linear modules), layers 0 and 2 MoE: 4 experts of 24, hidden 32
MOE = dict(vocab_size=64, hidden_dim=32, num_layers=3, num_heads=4, num_kv_heads=2,
           ffn_hidden_dim=48, moe_ffn_hidden_dim=24, max_seq_len=32, num_experts=4,
           experts_per_token=2, router_aux_loss_coef=0.05, mlp_only_layers=[1])  # fmt: skip


def adapted_decoder(targets, seed=3, **fields):
    with torch.device("meta"):
        model = decoder(**MOE, **fields)
    apply_lora(model, targets, rank=2, alpha=4)
    materialize(model, torch.device("cpu"), seed=seed)
    return model


def save_adapters(model, path, everything=False):
    """The trainable parameters of `model` (its adapters; `everything`: all parameters) as a
    .safetensors file freetx reads back as a LoRA checkpoint (the model's class and config
    in its metadata)."""
    import dataclasses
    import json

    from freetx.checkpoint.formats import (
        MODEL_CLASS_KEY,
        MODEL_CONFIG_KEY,
        SafetensorsStreamWriter,
        TensorInfo,
    )

    adapters = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad or everything}
    cls = type(model)
    metadata = {"format": "pt", MODEL_CLASS_KEY: f"{cls.__module__}.{cls.__qualname__}",
                MODEL_CONFIG_KEY: json.dumps(dataclasses.asdict(model.config))}  # fmt: skip
    infos = {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in adapters.items()}
    writer = SafetensorsStreamWriter(path, infos, metadata)
    for name, tensor in adapters.items():
        writer.write(name, tensor)
    writer.close()
    return path


def randomize_adapters(model, seed=0, std=0.3):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def test_native_expert_adapters_equal_a_per_expert_loop_of_the_updated_weights():
    torch.manual_seed(0)
    experts = LoRAGroupedExperts(GroupedExperts(3, 8, 6), rank=2, alpha=4)
    for param in experts.parameters():
        nn.init.normal_(param, std=0.3)
    counts = [2, 0, 3]  # an expert without tokens too
    x = torch.randn(5, 8)
    out = experts(x, counts)
    s, gate_up, down = 2.0, experts.lora_gate_up_proj, experts.lora_down_proj
    expected, row = [], 0
    for e, count in enumerate(counts):
        delta = s * gate_up.lora_b[e] @ gate_up.lora_a[e]  # [12, 8]: w1's rows, then w3's
        w1, w3 = experts.w1[e] + delta[:6], experts.w3[e] + delta[6:]
        w2 = experts.w2[e] + s * down.lora_b[e] @ down.lora_a[e]
        for t in range(row, row + count):
            expected.append(w2 @ (F.silu(w1 @ x[t]) * (w3 @ x[t])))
        row += count
    assert (out - torch.stack(expected)).abs().max() < 1e-5
    out.sum().backward()
    assert experts.w1.grad is None and gate_up.lora_a.grad.abs().sum() > 0


def test_a_fresh_expert_adapter_leaves_the_output_unchanged_and_merges_to_its_output():
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.device("meta"):
        plain = decoder(**MOE)
    materialize(plain, torch.device("cpu"), seed=3)
    model = adapted_decoder(["experts"]).eval()  # the same seed: the same base weights
    plain.eval()
    with torch.no_grad():
        assert torch.equal(model(ids), plain(ids))
        randomize_adapters(model)
        adapted = model(ids)
        assert (adapted - plain(ids)).abs().max() > 1e-2
        with adapters_disabled(model):
            assert torch.equal(model(ids), plain(ids))
        merge_adapters(model)
        assert type(model.layers[0].feed_forward.experts) is GroupedExperts
        assert (model(ids) - adapted).abs().max() < 1e-5


def hf_moe_block(family, hidden=12, ffn=8):
    """transformers' MoE block of a tiny config (hidden 12, experts of 8: no square
    tensor, so that a transposition shows), random weights."""
    transformers = pytest.importorskip("transformers")
    if family == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        config = transformers.Qwen2MoeConfig(hidden_size=hidden, moe_intermediate_size=ffn,
                                             shared_expert_intermediate_size=ffn, num_experts=4,
                                             num_experts_per_tok=2)  # fmt: skip
        block = Qwen2MoeSparseMoeBlock(config)
    else:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        config = transformers.GptOssConfig(hidden_size=hidden, intermediate_size=ffn,
                                           num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
        block = GptOssMLP(config)  # it returns (output, router scores)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.5)
    return block


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_transformers_experts_compute_with_each_experts_weight_plus_its_update(family):
    """GPT-OSS stores its experts [E, in, out] (`is_transposed`): the adapter's update is
    in that orientation, and its input side (B there) starts random, the other at zero."""
    block = hf_moe_block(family)
    reference = copy.deepcopy(block)

    def output(module, x):
        out = module(x)
        return out[0] if isinstance(out, tuple) else out

    adapt_experts(block, ["experts"], rank=2, alpha=4)
    experts = block.experts
    assert experts.gate_up_proj.shape[1:] == ((12, 16) if family == "gpt_oss" else (16, 12))
    for adapter in experts.adapters().values():
        for local in ("lora_a", "lora_b"):
            adapter.reset_parameter(local, getattr(adapter, local).data, torch.Generator())
        zero = adapter.lora_a if family == "gpt_oss" else adapter.lora_b
        assert zero.abs().max() == 0 and adapter.delta().abs().max() == 0
    x = torch.randn(2, 5, 12)
    assert torch.equal(output(block, x), output(reference, x))  # a fresh adapter: no change
    with torch.no_grad():
        for adapter in experts.adapters().values():
            adapter.lora_a.normal_(0.0, 0.5)
            adapter.lora_b.normal_(0.0, 0.5)
        for name, adapter in experts.adapters().items():  # per expert: W[e] + 2 B[e] A[e]
            weight = reference.experts.get_parameter(name)
            for e in range(4):
                weight[e] += 2.0 * adapter.lora_b[e] @ adapter.lora_a[e]
    out = output(block, x)
    assert (out - output(reference, x)).abs().max() < 1e-5
    assert isinstance(experts.get_parameter("gate_up_proj"), nn.Parameter)  # put back
    out.sum().backward()
    assert experts.gate_up_proj.grad is None
    assert experts.lora_down_proj.lora_a.grad.abs().sum() > 0
    with torch.no_grad():
        merge_expert_adapters(block)  # the updates added, transformers' class back
        assert type(block.experts) is type(reference.experts)
        assert not any("lora" in name for name, _ in block.named_parameters())
        assert (output(block, x) - out).abs().max() < 1e-5


@pytest.mark.parametrize("transposed", [False, True])
def test_peft_factors_hold_expert_e_in_rows_e_r_of_a_and_columns_e_mod_e_of_b(transposed):
    """PEFT 0.21's ParamWrapper: A_e = lora_A.reshape(E, r, in)[e], B_e = lora_B.reshape(out,
    r, E)[:, :, e], and expert e's update alpha/r B_e A_e [out, in] is freetx's (transposed
    where the tensor is stored [E, in, out])."""
    from freetx.checkpoint.adapters import expert_peft_factors
    from freetx.models.peft.experts import expert_delta

    experts, rank, rows, cols = 3, 2, 5, 7  # stored [E, rows, cols]
    a, b = torch.randn(experts, rank, cols), torch.randn(experts, rows, rank)
    peft_a, peft_b = expert_peft_factors(a, b, transposed)
    inputs, outputs = (rows, cols) if transposed else (cols, rows)
    assert peft_a.shape == (rank * experts, inputs) and peft_b.shape == (outputs, rank * experts)
    ours = expert_delta(a, b, 2.0)
    for e in range(experts):
        a_e = peft_a.reshape(experts, rank, inputs)[e]
        b_e = peft_b.reshape(outputs, rank, experts)[:, :, e]
        theirs = 2.0 * b_e @ a_e
        assert torch.allclose(theirs, ours[e].T if transposed else ours[e], atol=1e-6)


def adapted_names(targets, **peft):
    with torch.device("meta"):
        model = decoder(**MOE)
    return apply_lora(model, targets, rank=2, alpha=4, **peft), model


def test_the_experts_target_adapts_the_experts_alone_and_all_linear_includes_them():
    names, model = adapted_names(["experts"])
    assert names == ["layers.0.feed_forward.experts", "layers.2.feed_forward.experts"]
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {
        f"layers.{i}.feed_forward.experts.lora_{p}_proj.lora_{f}"
        for i in (0, 2)
        for p in ("gate_up", "down")
        for f in ("a", "b")
    }
    everything, _ = adapted_names(["all-linear"])
    assert set(names) < set(everything) and "layers.1.feed_forward.w1" in everything
    assert "layers.0.attention.wq" in everything and "output" not in everything
    combined, _ = adapted_names(["q", "gate", "experts"])  # gate: the dense layer's w1
    assert combined == ["layers.0.attention.wq", "layers.0.feed_forward.experts",
                        "layers.1.attention.wq", "layers.1.feed_forward.w1",
                        "layers.2.attention.wq", "layers.2.feed_forward.experts"]  # fmt: skip


def test_an_mlp_target_without_experts_is_refused_naming_the_experts_target():
    with pytest.raises(ConfigError, match=r"grouped tensor of all experts.*target `experts`"):
        adapted_names(["q", "gate"])


def test_down_proj_on_transformers_experts_without_experts_is_refused_with_hf_names():
    """Qwen2-MoE's shared expert has a down_proj Linear, its experts a 3-D down_proj: PEFT's
    target_modules would adapt the first and silently miss the second."""
    block = hf_moe_block("qwen2_moe")
    with pytest.raises(
        ConfigError, match=r"\(experts\.down_proj\).*\[q_proj,k_proj,v_proj,o_proj,"
    ):
        apply_lora(block, ["down_proj"], rank=2, alpha=4)
    assert apply_lora(block, ["down_proj", "experts"], rank=2, alpha=4) == [
        "experts", "shared_expert.down_proj"]  # fmt: skip


def test_the_experts_target_on_a_dense_model_is_refused_saying_it_has_no_moe_block():
    with torch.device("meta"):
        model = decoder(**{**MOE, "num_experts": 0, "mlp_only_layers": []})
    with pytest.raises(ConfigError, match=r"'experts' match no Linear module.*no MoE block"):
        apply_lora(model, ["experts"], rank=2, alpha=4)


@pytest.mark.parametrize(
    "targets,peft,message",
    [(["experts"], dict(dropout=0.1), r"'peft.dropout' is 0.1: LoRA on MoE experts.*peft.dropout=0"),
     (["all-linear"], dict(dropout=0.1), r"PEFT refuses lora_dropout on them"),
     (["experts"], dict(use_dora=True), r"'peft.use_dora' is True: DoRA .* no DoRA for the grouped"),
     (["experts"], dict(rank=9), r"peft.rank=9 does not fit the experts of layers.0"
                                 r".*at most the smaller side, 8")],
)  # fmt: skip
def test_what_lora_on_experts_does_not_do_is_refused_by_name(targets, peft, message):
    options = {"rank": 2, "alpha": 4, **peft}
    with torch.device("meta"):
        model = decoder(**{**MOE, "moe_ffn_hidden_dim": 8})
    with pytest.raises(ConfigError, match=message):
        apply_lora(model, targets, **options)


def test_the_experts_target_with_dropout_or_dora_is_refused_by_the_config_itself():
    """Before a model is built (`freetx validate`, the checks before a run); QLoRA's NF4
    bases are not refused."""
    from freetx.models.peft import PEFTConfig

    for key, value in (("dropout", 0.1), ("use_dora", True)):
        with pytest.raises(ValueError, match=rf"'{key}' is {value!r}: .*experts"):
            PEFTConfig(method="lora", target_modules=["q", "experts"], **{key: value})
    assert PEFTConfig(method="lora", target_modules=["q", "experts"], quantize_base="nf4")


def test_estimate_counts_the_expert_adapters_and_their_bases_in_the_compute_dtype_or_nf4():
    from freetx.distributed import frozen_base
    from freetx.planning.estimate import parameter_bytes

    _, model = adapted_names(["experts"])
    with torch.device("meta"):
        plain = decoder(**MOE)  # every parameter trains: fp32
    stored, trained = parameter_bytes(model, 2, frozen_base(model))
    experts, hidden, ffn, rank = 4, 32, 24, 2
    per_block = experts * rank * (hidden + 2 * ffn) + experts * rank * (ffn + hidden)
    assert trained == 2 * per_block  # two MoE blocks
    bases = 2 * 3 * experts * hidden * ffn
    plain_stored, _ = parameter_bytes(plain, 2, frozen_base(plain))
    assert stored == plain_stored - 2 * bases + 4 * trained  # the bases in bf16
    pytest.importorskip("torchao")
    from freetx.models.peft.nf4 import BYTES_PER_WEIGHT, quantize_bases

    quantize_bases(model)  # QLoRA: the experts' bases at NF4's 0.516 bytes per weight
    stored_nf4, trained_nf4 = parameter_bytes(model, 2, frozen_base(model))
    assert trained_nf4 == trained
    assert stored_nf4 == pytest.approx(stored - bases * (2 - BYTES_PER_WEIGHT))


def test_expert_adapters_initialize_themselves_kaiming_and_zero():
    adapter = ExpertLoRA(4, 6, 10, rank=2, alpha=4, transposed=False)
    generator = torch.Generator().manual_seed(0)
    a, b = torch.empty(4, 2, 10), torch.ones(4, 6, 2)
    adapter.reset_parameter("lora_a", a, generator)
    adapter.reset_parameter("lora_b", b, generator)
    assert b.abs().max() == 0 and 0 < a.abs().max() <= 1 / 10**0.5


def test_native_expert_adapters_export_one_peft_wrapper_per_transformers_parameter(tmp_path):
    """w1 and w3's adapter is transformers' gate_up_proj's (inner: `base_layer.`), w2's its
    down_proj's, under transformers 5's module name (mlp.experts), PEFT's shapes."""
    pytest.importorskip("transformers")
    import json

    from safetensors import safe_open

    from freetx.checkpoint import convert
    from freetx.checkpoint.adapters import LoRASettings

    model = adapted_decoder(
        ["q", "experts"], hf_model_type="qwen3_moe", qk_norm="head", expert_weights_fp32=False
    )  # qwen3_moe's
    randomize_adapters(model)
    file = save_adapters(model, tmp_path / "adapters.safetensors")
    convert(file, tmp_path / "peft", to="peft", lora=LoRASettings(alpha=4.0))
    with safe_open(tmp_path / "peft" / "adapter_model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    experts, rank, hidden, ffn = 4, 2, 32, 24
    for i in (0, 2):
        prefix = f"base_model.model.model.layers.{i}.mlp.experts."
        assert shapes.pop(prefix + "base_layer.lora_A.weight") == (rank * experts, hidden)
        assert shapes.pop(prefix + "base_layer.lora_B.weight") == (2 * ffn, rank * experts)
        assert shapes.pop(prefix + "lora_A.weight") == (rank * experts, ffn)
        assert shapes.pop(prefix + "lora_B.weight") == (hidden, rank * experts)
    assert set(shapes) == {f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{f}.weight"
                           for i in range(3) for f in "AB"}  # fmt: skip
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj"] and config["r"] == 2
    assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


def test_a_merge_adds_each_experts_update_to_w1_w3_and_w2_and_refuses_another_base(tmp_path):
    """`freetx checkpoint merge`'s source: w1 gets the first half of gate_up_proj's update,
    w3 the second, w2 down_proj's, as the model merges them; a base whose experts have
    another shape is refused naming the tensor."""
    from freetx.checkpoint.adapters import LoRASettings, MergedSource
    from freetx.checkpoint.formats import open_tensors
    from freetx.errors import CheckpointError

    model = adapted_decoder(["experts"])
    randomize_adapters(model)
    adapters = open_tensors(save_adapters(model, tmp_path / "adapters.safetensors"))
    with torch.device("meta"):
        plain = decoder(**MOE)
    materialize(plain, torch.device("cpu"), seed=3)  # the base the adapters were made on
    base = open_tensors(save_adapters(plain, tmp_path / "base.safetensors", everything=True))
    merged = MergedSource(base, adapters, LoRASettings(alpha=4.0))
    expected = model.layers[2].feed_forward.experts.merged()
    for name in ("w1", "w3", "w2"):
        tensor = merged.get(f"model.layers.2.feed_forward.experts.{name}")
        assert torch.allclose(tensor, expected[name], atol=1e-6), name
    with torch.device("meta"):
        other = decoder(**{**MOE, "moe_ffn_hidden_dim": 16})
    materialize(other, torch.device("cpu"), seed=3)
    wrong = open_tensors(save_adapters(other, tmp_path / "other.safetensors", everything=True))
    with pytest.raises(CheckpointError, match=r"expert adapter of layers.0.feed_forward.experts"
                       r".w1 is for a \[4, 24, 32\] tensor but the base .* has \[4, 16, 32\]"):  # fmt: skip
        MergedSource(wrong, adapters, LoRASettings(alpha=4.0))


# -- QLoRA: the experts' bases in NF4 (freetx.models.peft.nf4) ---------------------------


def with_nf4_bases(module, experts="experts"):
    """A copy of `module` whose adapted experts module `experts` keeps its bases in NF4,
    quantized from `module`'s (world size 1), the adapters the same; `module`'s bases are
    then set to the NF4 ones dequantized (fp32): the reference the NF4 copy must equal."""
    pytest.importorskip("torchao")
    from freetx.distributed.parameters import set_full_parameter
    from freetx.models.peft.nf4 import quantize_experts

    quantized = copy.deepcopy(module)
    quantize_experts(quantized.get_submodule(experts), experts, world_size=1)
    target = quantized.get_submodule(experts)
    with torch.no_grad():
        for name in target.nf4_shapes:
            full = f"{experts}.{name}" if experts else name
            set_full_parameter(quantized, full, module.get_parameter(full))
            module.get_parameter(full).copy_(target.dequantized(name, torch.float32))
    return quantized


def test_nf4_native_experts_compute_what_their_dequantized_bases_do_forward_and_backward():
    """`NF4GroupedLinear` dequantizes the whole grouped tensor in the forward and again in
    the backward: the output and the gradients of the input and the adapters are those of
    the same experts with the dequantized bases."""
    torch.manual_seed(0)
    reference = LoRAGroupedExperts(GroupedExperts(4, 32, 16), rank=2, alpha=4)
    for param in reference.parameters():
        nn.init.normal_(param, std=0.3)
    quantized = with_nf4_bases(reference, experts="")
    assert type(quantized).__name__ == "NF4LoRAGroupedExperts"
    assert quantized.w1.shape == (4 * 16, 32) and quantized.w2.shape == (4 * 32, 16)
    counts = [3, 0, 2, 2]  # an expert without tokens too
    x = torch.randn(7, 32)
    outputs, grads = [], []
    for experts in (quantized, reference):
        given = x.clone().requires_grad_(True)
        out = experts(given, counts)
        out.pow(2).sum().backward()
        outputs.append(out)
        grads.append([given.grad, *(p.grad for p in experts.parameters() if p.requires_grad)])
    assert torch.equal(outputs[0], outputs[1])
    for ours, theirs in zip(*grads, strict=True):
        assert torch.equal(ours, theirs)
    with adapters_disabled(quantized), adapters_disabled(reference):
        assert torch.equal(quantized(x, counts), reference(x, counts))


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_nf4_transformers_experts_compute_with_their_dequantized_bases(family):
    """GPT-OSS's experts are stored [E, in, out]: kept as NF4 [E * in, out]."""
    block = hf_moe_block(family, hidden=16, ffn=32)  # 64 x 16 and 16 x 32: no square
    adapt_experts(block, ["experts"], rank=2, alpha=4)
    randomize_adapters(block)
    quantized = with_nf4_bases(block, experts="experts")
    stored = (4 * 16, 64) if family == "gpt_oss" else (4 * 64, 16)  # gate_up_proj
    assert quantized.experts.gate_up_proj.shape == stored
    x = torch.randn(2, 5, 16)

    def output(module):
        out = module(x)
        return out[0] if isinstance(out, tuple) else out

    out = output(quantized)
    assert torch.equal(out, output(block))
    out.sum().backward()
    assert quantized.experts.lora_down_proj.lora_a.grad.abs().sum() > 0
    with adapters_disabled(quantized), adapters_disabled(block):
        assert torch.equal(output(quantized), output(block))
    with torch.no_grad():  # a merge: the dequantized base plus the update, transformers' class
        merge_expert_adapters(quantized)
        merge_expert_adapters(block)
        assert type(quantized.experts) is type(block.experts)
        assert torch.equal(quantized.experts.gate_up_proj, block.experts.gate_up_proj)


def test_an_nf4_expert_base_has_the_error_of_nf4_as_each_experts_own_linear_would():
    """Relative error |dequantized - W| / |W| (means) of a grouped tensor [8, 64, 32] kept
    as one NF4 tensor, against each expert's [64, 32] quantized as a Linear's base
    (measured 0.0919 and 0.0919: the same blocks of 64, other double-quantization blocks)."""
    pytest.importorskip("torchao")
    from freetx.models.peft.nf4 import NF4Experts, block_sizes, dense_experts, quantized

    weight = (torch.randn(8, 64, 32, generator=torch.Generator().manual_seed(0)) * 0.02).to(
        torch.bfloat16
    )
    experts = NF4Experts()
    experts.nf4_shapes = {"w1": (8, 64, 32)}
    experts.nf4_blocks = {"w1": block_sizes((8 * 64, 32), 1, "w1")}
    grouped = dense_experts(experts.stored_value("w1", weight, None), (8, 64, 32), torch.float32)
    each = torch.stack(
        [quantized(w, block_sizes((64, 32), 1, "w"), None).get_original_weight() for w in weight]
    ).float()

    def error(dense):
        return float((dense - weight.float()).abs().mean() / weight.float().abs().mean())

    assert 0.05 < error(grouped) < 0.15  # NF4's 4 bits
    assert abs(error(grouped) - error(each)) < 0.01 * error(each)


def test_qlora_on_experts_whose_rows_do_not_split_into_whole_blocks_is_refused_by_name():
    """4 experts of 24 x 32 on 5 ranks: 96 rows do not split into 5 equal shares."""
    pytest.importorskip("torchao")
    from freetx.models.peft.nf4 import quantize_bases

    _, model = adapted_names(["experts"])
    with pytest.raises(ConfigError, match=r"QLoRA cannot quantize layers.0.feed_forward.experts"
                       r".w1 \(its 4 experts' rows one after the other\) \[96, 32\] for 5 "
                       r"rank\(s\)"):  # fmt: skip
        quantize_bases(model, world_size=5)


@pytest.mark.parametrize("axis", ["tp", "ep"])
def test_qlora_on_experts_with_tensor_or_expert_parallelism_is_refused_by_validate(axis):
    """Before anything is launched, as an NF4 Linear base is with tp (by then, inside the
    run): torchao's NF4 tensors shard over fsdp's ranks only."""
    from tests.conftest import flat, run_freetx_here

    model = ["model.num_experts=4", "model.experts_per_token=2"] if axis == "ep" else []
    result = run_freetx_here(
        "validate", "llm/qlora_tiny", f"distributed.{axis}=2", "--world-size", "2", *model,
        "peft.target_modules=[q,experts]", "peft.dropout=0",
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "QLoRA keeps the MoE experts' bases as NF4 tensors" in flat(result.stdout)
    assert f"Use LoRA on the experts with {axis} (peft.quantize_base=none)" in flat(result.stdout)

"""Quantization-aware training on torchao (freetx.models.qat), on a tiny decoder on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from freetx.distributed import materialize
from freetx.errors import ConfigError
from freetx.fields import field_problems
from freetx.models.peft import apply_lora
from freetx.models.qat import (
    QATConfig,
    QATLoRALinear,
    QuantScheme,
    apply_qat,
    convert_qat,
    flat_quantized,
    hf_quantization_config,
    quantize_ptq,
    real_config,
    set_fake_quantization,
)
from freetx.models.transformer import decoder

SCHEMES = ["int4_weight", "int8_dynamic_act_int4_weight"]
IDS = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(0))
BLOCK_LINEARS = 4 * 7  # the tiny preset: 4 blocks of q, k, v, o, gate, up, down


def tiny(seed: int = 5, lora: list[str] = ()) -> nn.Module:
    with torch.device("meta"):
        model = decoder(preset="tiny", vocab_size=259, max_seq_len=64)
        if lora:
            apply_lora(model, list(lora), rank=4, alpha=8)
    materialize(model, torch.device("cpu"), seed=seed)
    return model


def loss_of(model: nn.Module) -> torch.Tensor:
    logits = model(IDS[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), IDS[:, 1:].flatten())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fake_quantization_changes_the_forward_and_off_gives_the_plain_logits(scheme):
    model = tiny()
    with torch.no_grad():
        plain = model(IDS)
        names = apply_qat(model, QATConfig(scheme=scheme))
        fake = model(IDS)
        set_fake_quantization(model, False)
        off = model(IDS)
    assert len(names) == BLOCK_LINEARS
    assert not torch.allclose(fake, plain, atol=1e-2)
    assert torch.equal(off, plain)


def test_the_embedding_and_output_head_are_not_prepared():
    with torch.device("meta"):
        model = decoder(preset="tiny", vocab_size=259, max_seq_len=64, tie_embeddings=False)
    names = apply_qat(model, QATConfig(scheme="int8_dynamic_act_int4_weight"))
    assert "output" not in names and "tok_embeddings" not in names
    assert type(model.output) is nn.Linear and type(model.tok_embeddings) is nn.Embedding


def test_a_backward_reaches_every_prepared_weight():
    model = tiny()
    names = apply_qat(model, QATConfig(scheme="int8_dynamic_act_int4_weight"))
    loss_of(model).backward()
    for name in names:
        grad = model.get_submodule(name).weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


# Real quantized logits against the fake-quantized ones (fp32, CPU), measured: int8 dynamic
# activations + int4 weights equal (IntxUnpackedToInt8Tensor computes the same dequantized
# products); int4 weight-only differ by 4.6e-5 at most (logits of magnitude ~5: the CPU int4
# kernel, `_weight_int4pack_mm_for_cpu`, sums in another order); bounds with some room for that.
@pytest.mark.parametrize(
    "scheme, atol", [("int4_weight", 1e-3), ("int8_dynamic_act_int4_weight", 1e-5)]
)
def test_converted_logits_are_close_to_the_fake_quantized_ones(scheme, atol):
    model = tiny()
    cfg = QATConfig(scheme=scheme)
    apply_qat(model, cfg)
    with torch.no_grad():
        fake = model(IDS)
        real = convert_qat(model, cfg)(IDS)
    quantized = model.layers[0].attention.wq.weight
    assert type(quantized) is not nn.Parameter or type(quantized.data) is not torch.Tensor
    assert torch.allclose(real, fake, atol=atol, rtol=0)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_ptq_runs_on_a_plain_model(scheme):
    model = tiny()
    with torch.no_grad():
        plain = model(IDS)
        quantize_ptq(model, QuantScheme(scheme, 32))
        quantized = model(IDS)
    weight = model.layers[0].feed_forward.w2.weight
    assert type(weight.data).__name__ in ("Int4OpaqueTensor", "IntxUnpackedToInt8Tensor")
    assert type(model.tok_embeddings.weight.data) is torch.Tensor  # not quantized
    error = (quantized - plain).abs().mean() / plain.abs().mean()
    assert 0 < error < 0.5


def test_a_prepared_meta_model_materializes_as_the_plain_one():
    with torch.device("meta"):
        model = decoder(preset="tiny", vocab_size=259, max_seq_len=64)
        apply_qat(model, QATConfig(scheme="int4_weight"))
    materialize(model, torch.device("cpu"), seed=5)
    set_fake_quantization(model, False)
    with torch.no_grad():
        assert torch.equal(model(IDS), tiny()(IDS))


def test_a_state_dict_round_trip_of_a_prepared_model_keeps_its_logits():
    cfg = QATConfig(scheme="int8_dynamic_act_int4_weight")
    model = tiny()
    apply_qat(model, cfg)
    state = model.state_dict()
    assert set(state) == set(tiny().state_dict())  # the plain model's names: checkpoints load
    again = tiny(seed=6)
    apply_qat(again, cfg)
    with torch.no_grad():
        assert not torch.equal(again(IDS), model(IDS))
        again.load_state_dict(state)
        assert torch.equal(again(IDS), model(IDS))


def test_fully_shard_over_a_prepared_model_gives_the_unsharded_loss():
    from torch.distributed.fsdp import fully_shard

    from freetx.distributed.runtime import destroy_distributed, init_distributed

    model = tiny()
    apply_qat(model, QATConfig(scheme="int8_dynamic_act_int4_weight"))
    expected = loss_of(model).detach()
    sharded = copy.deepcopy(model)
    init_distributed("cpu")
    try:
        for block in sharded.layers:
            fully_shard(block)
        fully_shard(sharded)
        loss = loss_of(sharded)
        loss.backward()
    finally:
        destroy_distributed()
    assert torch.equal(loss.detach(), expected)
    assert sharded.layers[0].attention.wq.weight.grad is not None


def test_lora_layers_fake_quantize_their_base_and_convert_merged():
    cfg = QATConfig(scheme="int8_dynamic_act_int4_weight")
    model = tiny(lora=["q", "v"])
    with torch.no_grad():
        lora = model(IDS)
        names = apply_qat(model, cfg)
        fake = model(IDS)
        set_fake_quantization(model, False)
        off = model(IDS)
    layer = model.layers[0].attention.wq
    assert len(names) == BLOCK_LINEARS and isinstance(layer, QATLoRALinear)
    assert not layer.weight.requires_grad and layer.lora_a.weight.requires_grad
    assert torch.equal(off, lora) and not torch.allclose(fake, lora, atol=1e-2)
    set_fake_quantization(model, True)
    with torch.no_grad():  # fresh adapters (B = 0): merged, the same weights as trained
        assert torch.allclose(convert_qat(model, cfg)(IDS), fake, atol=1e-5, rtol=0)
    assert type(model.layers[0].attention.wq) is nn.Linear


def test_a_qlora_base_is_refused():
    with torch.device("meta"):
        model = decoder(preset="tiny", vocab_size=259, max_seq_len=64)
    from freetx.models.peft import PEFTConfig, apply_peft

    apply_peft(model, PEFTConfig(method="lora", target_modules=["q"], quantize_base="nf4"))
    with pytest.raises(ConfigError, match="NF4 base .*peft.quantize_base=none"):
        apply_qat(model, QATConfig(scheme="int4_weight"))


def test_a_group_size_that_does_not_divide_a_linear_is_refused_naming_it():
    with torch.device("meta"):
        model = decoder(preset="tiny", vocab_size=259, max_seq_len=64)
    # hidden 192 = 64 x 3: groups of 128 do not fit
    with pytest.raises(
        ConfigError, match=r"192 input columns of layers.0.attention.wq.*16, 32, 64"
    ):
        apply_qat(model, QATConfig(scheme="int8_dynamic_act_int4_weight", group_size=128))


@pytest.mark.parametrize(
    "values, key, says",
    [
        ({"scheme": "8da4w"}, "scheme", "did you mean 'int8_dynamic_act_int4_weight'"),
        ({"scheme": "int8_dynamic_activation_int4_weight"}, "scheme", "'int8_dynamic_act_int4"),
        ({"scheme": "int4_weight_only"}, "scheme", "did you mean 'int4_weight'"),
        ({"scheme": "Int4WeightOnlyConfig"}, "scheme", "did you mean 'int4_weight'"),
        (
            {"scheme": "Int8DynActInt4WeightQATQuantizer"},
            "scheme",
            "'int8_dynamic_act_int4_weight'",
        ),
        ({"scheme": "int4_wieght"}, "scheme", "did you mean 'int4_weight'"),
        ({"scheme": "int4_weight", "group_size": 256}, "group_size", "32, 64 or 128"),
        ({"scheme": "int8_dynamic_act_int4_weight", "group_size": 48}, "group_size", "power of 2"),
        ({"scheme": "int8_dynamic_act_int4_weight", "group_size": 8}, "group_size", "16 or more"),
        ({"start_step": 100}, "start_step", "qat.scheme is none"),
    ],
)
def test_meaningless_values_are_refused_with_the_fix(values, key, says):
    problems = field_problems(QATConfig, values, "qat.")
    assert len(problems) == 1 and problems[0].startswith(f"'qat.{key}'") and says in problems[0]
    with pytest.raises(ValueError, match=key):
        QATConfig(**values)


def test_sensible_values_are_accepted():
    for scheme in SCHEMES:
        assert (
            field_problems(QATConfig, {"scheme": scheme, "group_size": 64, "start_step": 5}) == []
        )
    assert field_problems(QATConfig, {}) == []


def test_a_quantized_state_round_trips_through_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    model = quantize_ptq(tiny(), QuantScheme("int8_dynamic_act_int4_weight", 32))
    tensors, metadata = flat_quantized(model.state_dict())
    save_file(tensors, tmp_path / "model.safetensors", metadata=metadata)
    state, left = unflatten_tensor_state_dict(load_file(tmp_path / "model.safetensors"), metadata)
    again = quantize_ptq(tiny(seed=6), QuantScheme("int8_dynamic_act_int4_weight", 32))
    again.load_state_dict(state, assign=True)
    with torch.no_grad():
        assert not left and torch.equal(again(IDS), model(IDS))


def test_the_cpu_int4_format_is_refused_for_export_with_the_fix():
    model = quantize_ptq(tiny(), QuantScheme("int4_weight", 32))
    with pytest.raises(ConfigError, match="Int4OpaqueTensor.*CUDA machine.*int8_dynamic_act"):
        flat_quantized(model.state_dict())


@pytest.mark.slow
def test_transformers_loads_an_export_with_the_same_logits(tmp_path):
    """A Llama quantized by quantize_ptq, written as an export is (flat_quantized and
    hf_quantization_config), loads in transformers as the same quantized model."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = quantize_ptq(
        LlamaForCausalLM(config).eval(), QuantScheme("int8_dynamic_act_int4_weight", 32)
    )
    tensors, metadata = flat_quantized(model.state_dict())
    save_file(tensors, tmp_path / "model.safetensors", metadata=metadata)
    written = config.to_dict() | {
        "quantization_config": hf_quantization_config(
            QuantScheme("int8_dynamic_act_int4_weight", 32), torch.device("cpu")
        )
    }
    (tmp_path / "config.json").write_text(json.dumps(written))
    on_cuda = hf_quantization_config(QuantScheme("int4_weight", 64), torch.device("cuda"))
    assert on_cuda["quant_type"]["default"]["_type"] == "Int4WeightOnlyConfig"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded.model.layers[0].mlp.down_proj.weight.data).__name__ == (
        "IntxUnpackedToInt8Tensor"
    )
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


def test_the_real_kernels_are_chosen_by_the_device():
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import Int4WeightOnlyConfig, Int8DynamicActivationIntxWeightConfig

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert isinstance(
        real_config(QuantScheme("int4_weight", 64), cpu), PrototypeInt4WeightOnlyConfig
    )
    on_cuda = real_config(QuantScheme("int4_weight", 64), cuda)
    assert isinstance(on_cuda, Int4WeightOnlyConfig) and on_cuda.group_size == 64
    for device in (cpu, cuda):
        config = real_config(QuantScheme("int8_dynamic_act_int4_weight", 64), device)
        assert isinstance(config, Int8DynamicActivationIntxWeightConfig)
        assert config.weight_dtype == torch.int4 and config.weight_granularity.group_size == 64


def test_a_quant_scheme_refuses_an_unknown_scheme_with_the_fix():
    with pytest.raises(ConfigError, match="quantize: 'scheme' is '8da4w'.*did you mean"):
        QuantScheme("8da4w", 32)
    with pytest.raises(ConfigError, match="quantize: scheme none quantizes nothing"):
        QuantScheme("none", 32)
    assert QuantScheme.named("8da4w", 64) == QuantScheme("int8_dynamic_act_int4_weight", 64)

"""The generic transformers path (freetx.models.hf_generic): causal LMs freetx has no
native layout for, from folders transformers wrote, give transformers' logits; HF -> DCP
-> HF gives the same tensors back; LoRA adapters export to a folder PEFT loads with
freetx's logits; what the path cannot read is refused by name."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from freetx.checkpoint import convert, load_initial_weights
from freetx.checkpoint.adapters import LoRASettings
from freetx.distributed import materialize
from freetx.models import hf_model
from tests.conftest import flat, one_paragraph, run_freetx, run_freetx_here
from tests.hf_folders import GENERIC_FAMILIES, hf_logits, make_folder

transformers = pytest.importorskip("transformers")

# every generic family (gpt_neox's folders store lm_head as embed_out: transformers' rules)
READABLE = list(GENERIC_FAMILIES)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_generic")
    return {family: make_folder(root / family, family) for family in READABLE}


def build(folder, **fields):
    with torch.device("meta"):
        return hf_model(str(folder), **fields)


def load(folder, model=None):
    model = model or build(folder)
    materialize(model, torch.device("cpu"), seed=0, init_weights=False)
    load_initial_weights(model, folder)
    return model.eval()


def ids(seed=1):
    return torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", READABLE)
def test_each_architecture_gives_transformers_logits(folders, family):
    model = load(folders[family])
    assert model.describe() == f"generic transformers path for {family}"
    with torch.no_grad():
        assert (model(ids()) - hf_logits(folders[family], ids())).abs().max() < 1e-4


def test_a_native_model_type_builds_freetx_decoder(tmp_path):
    folder = make_folder(tmp_path / "qwen3", "qwen3")
    model = build(folder, max_seq_len=64)
    assert type(model).__name__ == "Transformer" and model.config.max_seq_len == 64
    assert model.describe() == "native freetx decoder for qwen3"


def test_blocks_and_tied_weights_come_from_the_architecture(folders):
    model = build(folders["starcoder2"])
    assert [t.__name__ for t in model.block_types] == ["Starcoder2DecoderLayer"]
    assert model.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    loaded = load(folders["starcoder2"])  # materialize ties them again
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    from freetx.checkpoint.loading import model_shapes

    assert "lm_head.weight" not in model_shapes(loaded)  # saved once


def test_random_init_and_buffers(folders):
    """Without a folder's weights: Linear/Embedding ~ N(0, initializer_range), norms one,
    biases zero; the RoPE tables and Gemma's embedding scale computed on the device."""
    model = build(folders["gemma"])
    materialize(model, torch.device("cpu"), seed=0)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folders["gemma"])
    rope = model.model.rotary_emb
    assert torch.equal(rope.inv_freq, reference.model.rotary_emb.inv_freq)
    assert float(model.model.embed_tokens.embed_scale) == 64**0.5
    assert 0.015 < float(model.model.layers[0].mlp.up_proj.weight.detach().std()) < 0.025
    assert torch.all(model.model.layers[0].input_layernorm.weight == 1.0)
    with torch.no_grad():
        assert torch.isfinite(model(ids())).all()


def test_random_init_of_moe_experts_and_routers():
    """transformers' MoE modules (fused experts [E, 2I, H], a router's weight, gpt-oss's
    expert biases) start as their models' `_init_weights` starts them."""
    from freetx.models.hf_generic import HFGenericConfig, HFGenericModel

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    config = transformers.Qwen2MoeConfig(**shape, num_experts=4, moe_intermediate_size=32)
    with torch.device("meta"):
        model = HFGenericModel(HFGenericConfig(config.to_dict()))
    materialize(model, torch.device("cpu"), seed=0)
    mlp = model.model.layers[0].mlp
    assert mlp.experts.gate_up_proj.dim() == 3
    assert 0.015 < float(mlp.experts.gate_up_proj.detach().std()) < 0.025
    assert 0.015 < float(mlp.gate.weight.detach().std()) < 0.025
    config = transformers.GptOssConfig(**shape, num_local_experts=4)
    with torch.device("meta"):
        model = HFGenericModel(HFGenericConfig(config.to_dict()))
    bias = torch.ones(4, 64)
    model.init_parameter("model.layers.0.mlp.experts.gate_up_proj_bias", bias, None)
    assert torch.all(bias == 0.0)


@pytest.mark.parametrize("family", ["starcoder2", "granite", "phi"])
def test_hf_to_dcp_to_hf_gives_the_tensors_back_and_loads_in_transformers(tmp_path, family):
    source = make_folder(tmp_path / "src", family, dtype=torch.bfloat16)
    for args in (
        (str(source), str(tmp_path / "dcp"), "--to", "dcp"),
        (str(tmp_path / "dcp"), str(tmp_path / "out"), "--to", "hf", "--max-shard-size", "30KB"),
    ):
        result = run_freetx_here("checkpoint", "convert", *args)
        assert result.returncode == 0, result.stderr
    from safetensors.torch import load_file

    def tensors(folder):
        return {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}

    before, after = tensors(source), tensors(tmp_path / "out")
    assert sorted(before) == sorted(after)
    assert all(
        after[k].dtype == torch.bfloat16 and torch.equal(before[k], after[k]) for k in before
    )
    assert torch.equal(hf_logits(source, ids()), hf_logits(tmp_path / "out", ids()))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == family and config["dtype"] == "bfloat16"
    with torch.device("meta"):  # a bf16 folder still builds float32 parameters (the run
        assert {p.dtype for p in hf_model(str(source)).parameters()} == {torch.float32}  # casts)


@pytest.mark.parametrize("family,targets", [("starcoder2", ["q_proj", "v_proj"]),
                                            ("phi", ["all-linear"])])  # fmt: skip
def test_lora_adapters_export_to_a_folder_peft_loads_with_the_same_logits(
    tmp_path, folders, family, targets
):
    peft = pytest.importorskip("peft")
    from safetensors.torch import save_file

    from freetx.checkpoint.formats import MODEL_CLASS_KEY, MODEL_CONFIG_KEY
    from freetx.models.peft import apply_lora

    folder = folders[family]
    model = build(folder)
    adapted = apply_lora(model, targets, rank=4, alpha=8.0)
    assert "lm_head" not in adapted  # all-linear leaves the output head alone
    load(folder, model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_b" in name:
                param.normal_(0.0, 0.05, generator=generator)
        ours = model(ids())
    meta = {
        MODEL_CLASS_KEY: "freetx.models.hf_generic.HFGenericModel",
        MODEL_CONFIG_KEY: json.dumps(model.config.__dict__),
    }
    save_file(dict(model.state_dict()), str(tmp_path / "adapted.safetensors"), metadata=meta)
    convert(tmp_path / "adapted.safetensors", tmp_path / "peft", to="peft",
            lora=LoRASettings(alpha=8.0))  # fmt: skip
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()(ids()).logits
        assert (ours - theirs).abs().max() < 1e-4
        assert (ours - hf_logits(folder, ids())).abs().max() > 1e-3  # the adapters count


def test_without_transformers_the_generic_path_says_how_to_install_it(tmp_path, folders):
    """transformers made unimportable (a package of that name that raises ImportError)."""
    fake = tmp_path / "site" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no transformers here')\n")
    paths = [str(tmp_path / "site"), *sys.path]
    env = {"PYTHONPATH": ":".join(paths)}
    result = run_freetx("checkpoint", "convert", str(folders["phi"]), str(tmp_path / "dcp"),
                        "--to", "dcp", env=env)  # fmt: skip
    assert "pip install 'freetx[hf]'" in one_paragraph(result)
    assert "'phi' model" in flat(result.stderr)


def test_estimate_counts_a_generic_model(folders):
    result = run_freetx_here("estimate", "llm/hf_tiny_full", f"model_dir={folders['granite']}")
    assert result.returncode == 0, result.stderr
    assert "fsdp" in result.stdout

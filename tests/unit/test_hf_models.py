"""HF model folders in and out: every Llama-family layout transformers writes loads into
freetx's decoder with transformers' logits, exports load back into transformers, and the
round trip HF -> DCP -> HF keeps every tensor bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from freetx.checkpoint import convert, load_initial_weights, open_tensors
from freetx.distributed import materialize
from freetx.errors import CheckpointError
from freetx.models.transformer import hf_decoder
from tests.conftest import flat, run_freetx_here
from tests.hf_folders import (
    FAMILIES,
    LONG_FACTOR,
    SHORT_FACTOR,
    greedy,
    hf_logits,
    make_folder,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {family: make_folder(root / family, family) for family in FAMILIES}


def load_freetx(folder, **fields):
    with torch.device("meta"):
        model = hf_decoder(str(folder), **fields)
    materialize(model, torch.device("cpu"), seed=0)
    load_initial_weights(model, folder)
    return model.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_gives_transformers_logits_and_greedy_continuations(folders, family):
    folder = folders[family]
    model = load_freetx(folder)
    ids = torch.randint(0, 384, (2, 160), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
    theirs = hf_logits(folder, ids)
    assert (ours - theirs).abs().max().item() < 1e-4
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = ids[:, :12]
    assert greedy(model, prompt, 8) == greedy(lambda x: reference(x).logits, prompt, 8)


def test_config_fields_are_read_from_both_layouts(folders):
    new, old = (open_tensors(folders[f]).model_config for f in ("llama3_2", "llama3_1_old_layout"))
    assert new["rope_theta"] == old["rope_theta"] == 500000.0  # not the 10000 default
    assert new["rope_scaling"] == old["rope_scaling"] == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }  # fmt: skip
    assert new["tie_embeddings"] and not old["tie_embeddings"]
    assert open_tensors(folders["llama2_old_layout"]).model_config["rope_theta"] == 10000.0
    qwen = open_tensors(folders["qwen2"]).model_config
    assert (qwen["qkv_bias"], qwen["wo_bias"], qwen["hf_model_type"]) == (True, False, "qwen2")
    assert open_tensors(folders["llama_head_dim"]).model_config["head_dim"] == 32
    for family, blocks in [("qwen3", ("head", "pre")), ("qwen3_old_layout", ("head", "pre")),
                           ("olmo2", ("projection", "post")),
                           ("olmo2_old_layout", ("projection", "post"))]:  # fmt: skip
        config = open_tensors(folders[family]).model_config
        assert (config["qk_norm"], config["norm_position"]) == blocks, family
        assert (config["qkv_bias"], config["wo_bias"]) == (False, False), family
    assert open_tensors(folders["qwen3"]).model_config["head_dim"] == 32
    assert open_tensors(folders["olmo2"]).model_config["rope_theta"] == 500000.0
    assert open_tensors(folders["olmo2_old_layout"]).model_config["rope_theta"] == 500000.0
    sliding, full = "sliding_attention", "full_attention"
    for family in ("gemma3_text", "gemma3_text_old_layout"):  # 4.x: rope_local_base_freq and
        config = open_tensors(folders[family]).model_config  # sliding_window_pattern
        assert (config["layer_types"], config["sliding_window"]) == ([sliding, sliding, full], 40)
        assert (config["rope_theta"], config["rope_local_theta"]) == (1e6, 1e4), family
        assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}, family
        assert (config["qk_norm"], config["norm_position"]) == ("head", "sandwich"), family
        assert config["attn_logit_softcap"] is config["final_logit_softcap"] is None
    for family, final in (("gemma2", 1.5), ("gemma2_old_layout", 30.0)):
        config = open_tensors(folders[family]).model_config
        assert (config["layer_types"], config["attn_logit_softcap"]) == ([sliding, full], 2.0)
        assert (config["final_logit_softcap"], config["activation"]) == (final, "gelu_tanh")
        assert config["norm_plus_one"] and config["scale_embeddings"] and config["tie_embeddings"]
    assert open_tensors(folders["mistral_window"]).model_config["sliding_window"] == 48
    assert open_tensors(folders["qwen2_window"]).model_config["layer_types"] == [full, sliding]
    smollm3 = open_tensors(folders["smollm3_window"]).model_config  # NoPE every 4th layer,
    assert smollm3["nope_layers"] == [3]  # which slides by default
    assert (smollm3["layer_types"], smollm3["sliding_window"]) == ([full] * 3 + [sliding], 48)


def test_a_gemma3_folder_reads_as_its_text_model(folders):
    """A multimodal gemma3 folder (Gemma3ForConditionalGeneration) is read as its text
    decoder: the fields of its text_config, the tensors under language_model., the vision
    tower's and projector's named as not read."""
    source = open_tensors(folders["gemma3"])
    assert source.model_config == open_tensors(folders["gemma3_text"]).model_config
    assert source.model_config["hf_model_type"] == "gemma3_text"
    assert sorted({n.split(".")[0] for n in source.skipped}) == [
        "multi_modal_projector", "vision_tower",
    ]  # fmt: skip
    assert len(source.model_names()) == len(open_tensors(folders["gemma3_text"]).model_names())


def test_a_gemma3_text_config_that_lists_few_fields_takes_transformers_defaults():
    """The Hub's Gemma 3 4B config.json (transformers 4.50) lists five fields of its text
    model; the rest are Gemma3TextConfig's defaults, read as transformers fills them in."""
    from freetx.models.transformer_hf import LLAMA_LAYOUT

    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
           "image_token_index": 262144, "mm_tokens_per_image": 256,
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                           "model_type": "gemma3_text", "num_hidden_layers": 34,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152,
                             "intermediate_size": 4304, "num_hidden_layers": 27,
                             "num_attention_heads": 16, "image_size": 896, "patch_size": 14,
                             "vision_use_head": False}}  # fmt: skip
    filled = transformers.Gemma3Config(**hub).text_config.to_dict()
    assert LLAMA_LAYOUT.from_hf_config(hub) == LLAMA_LAYOUT.from_hf_config(filled)
    fields = LLAMA_LAYOUT.from_hf_config(hub)
    assert (fields["vocab_size"], fields["num_heads"], fields["head_dim"]) == (262208, 8, 256)
    assert (fields["rope_theta"], fields["rope_local_theta"]) == (1e6, 1e4)
    assert fields["layer_types"].count("full_attention") == 5  # every 6th of 34


def test_phi_fields_are_read_from_both_layouts(folders):
    """Phi-3: fused projections, LongRoPE with the factor max/original (which sets the
    attention factor), the top-level original length; Phi-4-mini: partial rotary at the top."""
    plain, long, mini = (open_tensors(folders[f]).model_config
                         for f in ("phi3", "phi3_longrope", "phi4_mini_old_layout"))  # fmt: skip
    for config in (plain, long, mini):
        assert config["fused_projections"] and config["hf_model_type"] == "phi3"
        assert (config["qkv_bias"], config["qk_norm"], config["head_dim"]) == (False, None, 16)
    assert plain["rope_scaling"] is None and plain["partial_rotary_factor"] == 1.0
    assert long["rope_scaling"] == {
        "rope_type": "longrope", "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR,
        "original_max_position_embeddings": 64, "factor": 4.0,
    }  # fmt: skip
    assert mini["partial_rotary_factor"] == 0.75 and mini["tie_embeddings"]
    assert len(mini["rope_scaling"]["long_factor"]) == 6  # 0.75 * 16 dims rotated, 6 frequencies


@pytest.mark.parametrize("family", ["phi3_longrope", "phi4_mini_old_layout"])
def test_longrope_takes_short_factors_up_to_the_original_length_and_long_ones_beyond(
    folders, family
):
    """64 tokens (original_max_position_embeddings): short factors; 65: long ones, for every
    position, as transformers picks them by the length it is given."""
    model = load_freetx(folders[family])
    ids = torch.randint(0, 384, (1, 65), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        short, long = model(ids[:, :64]), model(ids)
    assert (short - hf_logits(folders[family], ids[:, :64])).abs().max().item() < 1e-4
    assert (long - hf_logits(folders[family], ids)).abs().max().item() < 1e-4
    assert (short - long[:, :64]).abs().max().item() > 1e-3  # the factors differ


def test_every_decoder_tensor_name_reads_back_through_its_folders_layout():
    """freetx -> HF -> freetx names for each model type's blocks (HF's
    post_attention_layernorm is the pre-MLP norm of Llama and the post-attention one of
    OLMo 2)."""
    from freetx.models.hf import layout_for_hf_config, layout_of
    from freetx.models.hf_families import FAMILIES
    from freetx.models.transformer import decoder

    writer = layout_of("freetx.models.transformer.Transformer")
    for model_type, family in FAMILIES.items():
        with torch.device("meta"):
            model = decoder(
                "tiny", qk_norm=family.qk_norm, norm_position=family.norm_position,
                fused_projections=family.fused_projections,
            )  # fmt: skip
        reader = layout_for_hf_config({"model_type": model_type})
        names = [name for name, _ in model.named_parameters()]
        assert [reader.from_hf_name(writer.to_hf_name(n)) for n in names] == names
    assert writer.to_hf_name("layers.1.post_ffn_norm.weight") == (
        "model.layers.1.post_feedforward_layernorm.weight"
    )
    assert writer.to_hf_name("layers.0.attention.wqkv.weight") == (
        "model.layers.0.self_attn.qkv_proj.weight"
    )
    assert writer.to_hf_name("layers.0.feed_forward.w13.weight") == (
        "model.layers.0.mlp.gate_up_proj.weight"
    )


def test_max_seq_len_can_shorten_the_tables_and_keeps_llama3_scaling(folders):
    short = load_freetx(folders["llama3_2"], max_seq_len=128)
    assert short.config.rope_scaling["original_max_position_embeddings"] == 64
    ids = torch.randint(0, 384, (1, 100))
    with torch.no_grad():
        assert (short(ids) - hf_logits(folders["llama3_2"], ids)).abs().max() < 1e-4


@pytest.mark.parametrize(
    "family",
    [
        "llama3_2",
        "qwen2",
        "mistral",
        "qwen3",
        "olmo2",
        "phi3",
        "phi4_mini_old_layout",
        "mixtral",
        "qwen3_moe",
        "mistral_window",
        "qwen2_window",
        "gemma2",
        "gemma3_text",
        "phi3_window",
        "smollm3",
        "smollm3_window",
    ],
)
def test_hf_to_dcp_to_hf_is_bit_for_bit_and_loads_in_transformers(tmp_path, family):
    source = make_folder(tmp_path / "src", family, dtype=torch.bfloat16)
    convert(source, tmp_path / "dcp", to="dcp")
    convert(tmp_path / "dcp", tmp_path / "out", to="hf", max_shard_size="30KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded as asked
    from safetensors import safe_open

    def tensors(folder):
        out = {}
        for file in folder.glob("*.safetensors"):
            with safe_open(str(file), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
        return out

    before, after = tensors(source), tensors(tmp_path / "out")
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == torch.bfloat16 and torch.equal(tensor, after[name]), name
    assert (tmp_path / "out" / "generation_config.json").is_file()
    ids = torch.randint(0, 384, (2, 40))
    assert torch.equal(hf_logits(source, ids), hf_logits(tmp_path / "out", ids))
    config, source_config = (
        json.loads((f / "config.json").read_text()) for f in (tmp_path / "out", source)
    )
    assert config["model_type"] == source_config["model_type"]
    if family in ("mistral_window", "qwen2_window", "gemma2", "gemma3_text", "phi3_window"):
        for key in ("sliding_window", "layer_types", "rope_parameters", "query_pre_attn_scalar",
                    "attn_logit_softcapping", "final_logit_softcapping"):  # fmt: skip
            if key == "rope_parameters" and family == "phi3_window":
                continue  # transformers writes partial_rotary_factor 1.0; freetx one below 1
            assert config.get(key) == source_config.get(key), key


# what makes a decoder Gemma's (with sliding layers 0 and 2 of the tiny preset's 4)
GEMMA = dict(norm_position="sandwich", norm_plus_one=True, scale_embeddings=True,
             activation="gelu_tanh", sliding_window=20,
             layer_types=["sliding_attention", "full_attention"] * 2)  # fmt: skip


def save_freetx_model(path, **fields):
    """A tiny decoder freetx made (not from HF), norms not all ones, as a .safetensors file
    that records its class and config."""
    from safetensors.torch import save_file

    from freetx.checkpoint.formats import MODEL_CLASS_KEY, MODEL_CONFIG_KEY
    from freetx.models.transformer import decoder

    with torch.device("meta"):
        model = decoder("tiny", vocab_size=300, rope_theta=10000.0, **fields)
    materialize(model, torch.device("cpu"), seed=3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1, generator=generator)
    meta = {
        MODEL_CLASS_KEY: "freetx.models.transformer.Transformer",
        MODEL_CONFIG_KEY: json.dumps(model.config.__dict__),
    }
    save_file(dict(model.state_dict()), str(path), metadata=meta)
    return model.eval()


@pytest.mark.parametrize(
    "fields",
    [{}, {"qk_norm": "head", "hf_model_type": "qwen3"},
     {"qk_norm": "projection", "norm_position": "post", "hf_model_type": "olmo2"},
     {"fused_projections": True, "partial_rotary_factor": 0.5, "hf_model_type": "phi3"},
     {"fused_projections": True, "hf_model_type": "phi3", "rope_scaling": {
         "rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(16)],
         "long_factor": [1.0 + i for i in range(16)], "original_max_position_embeddings": 32,
         "factor": 8.0}},
     {"sliding_window": 20, "hf_model_type": "mistral"},
     {"fused_projections": True, "sliding_window": 20, "hf_model_type": "phi3"},
     dict(GEMMA, attn_logit_softcap=3.0, final_logit_softcap=2.0, query_pre_attn_scalar=20,
          hf_model_type="gemma2"),
     dict(GEMMA, qk_norm="head", rope_local_theta=1000.0, rope_scaling={
         "rope_type": "linear", "factor": 2.0}, hf_model_type="gemma3_text"),
     {"nope_layers": [1, 3], "sliding_window": 20, "hf_model_type": "smollm3",
      "layer_types": ["full_attention", "sliding_attention"] * 2}],
)  # fmt: skip
def test_a_freetx_model_exports_to_an_hf_folder_transformers_loads(tmp_path, fields):
    """A decoder freetx made (not from HF) -> safetensors -> HF folder -> transformers."""
    model = save_freetx_model(tmp_path / "m.safetensors", **fields)
    result = run_freetx_here("checkpoint", "convert", str(tmp_path / "m.safetensors"),
                             str(tmp_path / "hf"), "--to", "hf")  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == fields.get("hf_model_type", "llama")
    for length in (30, 50):  # both of longrope's factors
        ids = torch.randint(0, 300, (2, length))
        with torch.no_grad():
            assert (hf_logits(tmp_path / "hf", ids) - model(ids)).abs().max() < 1e-4


@pytest.mark.parametrize(
    "fields,message",
    [({"qk_norm": "head"}, "an HF llama model has qk_norm=None, norm_position=pre; this one "
      "has qk_norm=head, norm_position=pre. Export it as qwen3"),
     ({"qk_norm": "projection", "hf_model_type": "qwen3"}, "convert it to .safetensors or DCP"),
     ({"qk_norm": "projection", "norm_position": "post", "hf_model_type": "olmo2",
       "head_dim": 16, "num_heads": 4}, "an HF olmo2 model has head_dim = hidden_size / heads"),
     ({"fused_projections": True}, "an HF llama model has fused_projections=False (q/k/v and "
      "gate/up apart); this one has fused_projections=True. Export it as phi3"),
     ({"hf_model_type": "phi3"}, "an HF phi3 model has fused_projections=True"),
     ({"fused_projections": True, "hf_model_type": "phi3", "qkv_bias": True, "wo_bias": True},
      "an HF phi3 model has no biases"),
     ({"partial_rotary_factor": 0.5}, "an HF llama model has default, llama3, linear RoPE on "
      "every dim of each head; this one has rope_type=default, partial_rotary_factor=0.5. Export "
      "it as phi3"),
     ({"fused_projections": True, "hf_model_type": "phi3",
       "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
      "an HF phi3 model has default, longrope RoPE; this one has rope_type=linear"),
     ({"sliding_window": 20}, "an HF llama model cannot have sliding_window=20, which this one "
      "has; an export would compute something else. Export it as mistral"),
     ({"nope_layers": [3]}, "an HF llama model cannot have nope_layers=[3], which this one "
      "has; an export would compute something else. Export it as smollm3"),
     ({"fused_projections": True, "hf_model_type": "phi3", "sliding_window": 20,
       "layer_types": ["sliding_attention", "full_attention"] * 2},
      'an HF phi3 model cannot have layer_types=["sliding_attention", "full_attention",'),
     (dict(GEMMA, hf_model_type="qwen3", qk_norm="head"), "an HF qwen3 model has qk_norm=head, "
      "norm_position=pre; this one has qk_norm=head, norm_position=sandwich. Export it as "
      "gemma3_text"),
     (dict(GEMMA, attn_logit_softcap=3.0, qk_norm="head", hf_model_type="gemma3_text"),
      "an HF gemma3_text model cannot have attn_logit_softcap=3.0")],
)  # fmt: skip
def test_a_model_whose_blocks_its_hf_type_lacks_is_not_exported(tmp_path, fields, message):
    save_freetx_model(tmp_path / "m.safetensors", **fields)
    result = run_freetx_here("checkpoint", "convert", str(tmp_path / "m.safetensors"),
                             str(tmp_path / "hf"), "--to", "hf")  # fmt: skip
    assert result.returncode == 1 and message in flat(result.stderr), result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "hf").exists()


def break_index(folder):
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = sorted(set(data["weight_map"].values()))[0]
    (folder / first).unlink()
    return first


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda f: (f / "config.json").unlink(), "has no config.json"),
        (lambda f: [p.unlink() for p in f.glob("model*")], "holds no .safetensors"),
        (break_index, "shard(s) that are not in the folder"),
        (lambda f: (f / "config.json").write_text("{not json"), "is not valid JSON"),
    ],
)  # fmt: skip
def test_a_damaged_folder_is_named(tmp_path, damage, message):
    folder = make_folder(tmp_path / "m", "llama3_2")
    damage(folder)
    with pytest.raises(CheckpointError) as error:
        load_freetx(folder)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"model_type": "gpt2"}, "describes a 'gpt2' model"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
         "rope_type=\"yarn\""),
        ({"hidden_act": "gelu"}, "hidden_act=\"gelu\""),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                              "long_factor": [2.0] * 8, "factor": 4.0,
                              "original_max_position_embeddings": 64}}, 'rope_type="longrope"'),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
         "quantization_config (quant_method=gptq): the folder holds quantized tensors"),
    ],
)  # fmt: skip
def test_what_freetx_cannot_compute_is_refused_with_the_field(tmp_path, change, message):
    folder = make_folder(tmp_path / "m", "mistral")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError) as error:
        load_freetx(folder)
    assert message in flat(str(error.value))


@pytest.mark.parametrize(
    "family,change,message",
    [("qwen3", {"layer_types": ["full_attention", "sliding_attention"]},
      'layer_types=["full_attention", "sliding_attention"]'),
     ("olmo2", {"hidden_act": "gelu"}, 'hidden_act="gelu"'),
     ("olmo2", {"sliding_window": 64}, "sliding_window=64"),
     ("gemma2", {"hidden_activation": "gelu"}, 'hidden_activation="gelu"'),
     ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
     ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
     ("gemma3_text", {"rope_parameters": {
         "full_attention": {"rope_type": "default", "rope_theta": 1e6},
         "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
      "rope_parameters.sliding_attention="),
     ("olmo2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
      'rope_type="yarn"'),
     ("phi3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
      'rope_type="dynamic"')],
)  # fmt: skip
def test_what_qwen3_olmo2_and_phi3_folders_ask_beyond_the_decoder_is_refused(
    folders, tmp_path, family, change, message
):
    import shutil

    folder = shutil.copytree(folders[family], tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError) as error:
        load_freetx(folder)
    assert message in flat(str(error.value))


def test_a_sliding_window_longer_than_the_sequences_is_allowed(tmp_path):
    folder = make_folder(tmp_path / "m", "mistral")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": 128}))
    model = load_freetx(folder, max_seq_len=128)
    assert model.config.max_seq_len == 128


def test_missing_and_misshaped_tensors_are_listed(tmp_path):
    folder = make_folder(tmp_path / "m", "llama_head_dim")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "head_dim": 16}))
    with pytest.raises(CheckpointError) as error:
        load_freetx(folder)
    assert "shape of layers.0.attention.wq.weight: model [64, 64], checkpoint [128, 64]" in str(
        error.value
    )


def test_an_export_onto_an_existing_folder_needs_overwrite(tmp_path, folders):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    result = run_freetx_here(
        "checkpoint", "convert", str(folders["qwen2"]), str(tmp_path / "out"), "--to", "hf"
    )
    assert result.returncode == 1 and "--overwrite" in flat(result.stderr)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("family", ["gemma2", "mixtral"])
def test_a_hook_named_as_transformers_names_it_reads_the_same_activations(folders, family):
    """A crosscoder hook written for transformers' model (model.layers.1, ...mlp) means the
    module of freetx's native decoder holding those tensors, with the same output."""
    import transformers

    from freetx.checkpoint import load_source_model
    from freetx.data.activations import ActivationHarvester
    from freetx.models.hf import own_module_name

    folder = folders[family]
    ours = load_source_model(str(folder), torch.device("cpu"), "float32")
    mlp = "block_sparse_moe" if family == "mixtral" else "mlp"
    assert own_module_name(ours, "model.layers.1") == "layers.1"
    assert own_module_name(ours, f"model.layers.1.{mlp}") == "layers.1.feed_forward"
    assert own_module_name(ours, "layers.0") == "layers.0"
    assert own_module_name(ours, "model.layers.9") == "model.layers.9"  # none: the error lists
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(3, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    keep = torch.ones_like(ids, dtype=torch.bool)
    hooks = ["model.layers.1"]
    mine = ActivationHarvester([(ours, [own_module_name(ours, h) for h in hooks], "ours")])
    reference = ActivationHarvester([(theirs, hooks, "transformers")])
    assert (mine(ids, keep) - reference(ids, keep)).abs().max() < 1e-4


def test_a_quantized_folder_is_refused_on_either_path(tmp_path):
    """hf_model refuses a folder of quantized tensors by name, before choosing a path."""
    from freetx.models import hf_model

    for family, method in (("qwen3", "awq"), ("starcoder2", "bitsandbytes")):  # native, generic
        folder = make_folder(tmp_path / family, family)
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = {"quant_method": method}
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=f"quant_method={method}"):
            hf_model(str(folder))

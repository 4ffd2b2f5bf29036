"""DeepSeek-V3, DeepSeek-V2 and GLM-4.5 folders read natively
(`freetx.models.hf_families.FAMILIES`: multi-head latent attention, sigmoid routing with
the stored bias and grouped top-k or V2's group-limited softmax, shared experts, dense
layers first): tiny sharded folders transformers wrote give its logits through
`load_model` (q_lora_rank set and None, RoPE interleaved or on halves, YaRN with biases
and 4 groups of experts, GLM-4.5's partial rotary and q/k/v biases), HF -> DCP -> HF
gives every stored tensor back bit for bit in its stored dtype (a bf16 folder's float32
router too), the stored router bias is read, the multi-token-prediction layer is not,
cached generation equals the uncached forward, and a 2-process fsdp fine-tune through
the CLI resumes exactly and exports under the folder's names."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.hf_folders import hf_logits, make_folder
from tests.recipes.test_moe_folders import exports_as_trained, finetunes_and_resumes, ids, stored

transformers = pytest.importorskip("transformers")

CASES = ["deepseek_v3", "deepseek_v3_q_proj", "deepseek_v3_yarn", "deepseek_v2", "glm4_moe",
         "glm4_moe_biases"]  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_folders")
    made = {case: make_folder(root / case, case) for case in CASES}
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        made["deepseek_v3"], dtype=torch.bfloat16
    )
    hf.save_pretrained(root / "deepseek_v3_bf16", max_shard_size="40KB")  # router kept float32
    made["deepseek_v3_bf16"] = root / "deepseek_v3_bf16"
    return made


@pytest.mark.parametrize("case", CASES)
def test_each_folder_gives_transformers_logits_natively(folders, case):
    from freetx.checkpoint import load_model

    folder = folders[case]
    model = load_model(folder, "cpu")
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    assert model.describe() == f"native freetx decoder for {model_type}"
    with torch.no_grad():
        diff = (model(ids()) - hf_logits(folder, ids())).abs().max().item()
    print(f"{case}: logits max diff vs transformers {diff:.2e}")
    assert diff <= 1e-4


@pytest.mark.parametrize("case", [*CASES, "deepseek_v3_bf16"])
def test_hf_to_dcp_to_hf_gives_each_stored_tensor_back_bit_for_bit(tmp_path, folders, case):
    from freetx.checkpoint import convert

    folder = folders[case]
    convert(folder, tmp_path / "dcp", to="dcp")
    convert(tmp_path / "dcp", tmp_path / "hf", to="hf", max_shard_size="40KB")
    before, after = stored(folder), stored(tmp_path / "hf")
    assert set(after) == set(before)  # per-expert names, the router bias
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    if case == "deepseek_v3_bf16":
        assert after["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
        assert after["model.layers.1.mlp.gate.weight"].dtype == torch.float32
        assert after["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    with torch.no_grad():  # the config.json written describes the same model
        assert (hf_logits(tmp_path / "hf", ids()) - hf_logits(folder, ids())).abs().max() == 0


def test_the_stored_router_bias_is_read_natively(folders):
    """e_score_correction_bias is a float32 buffer the folder stores: loaded, not zeroed."""
    from freetx.checkpoint import load_model

    folder = folders["deepseek_v3"]
    bias = stored(folder)["model.layers.1.mlp.gate.e_score_correction_bias"]
    model = load_model(folder, "cpu")
    held = model.get_buffer("layers.1.feed_forward.e_score_correction_bias")
    assert bias.abs().max() > 0.1 and torch.equal(held, bias) and held.dtype == torch.float32
    with torch.no_grad():
        read = model(ids())
        held.zero_()  # the bias chooses experts: without it the logits differ
        assert (model(ids()) - read).abs().max() > 1e-3


def test_the_multi_token_prediction_layer_is_not_read(tmp_path, folders):
    """DeepSeek-V3's folders store layer num_hidden_layers (MTP: `model.layers.61.*`), which
    transformers does not load either: skipped, the logits still transformers'."""
    from safetensors.torch import load_file, save_file

    from freetx.checkpoint import load_model

    folder = shutil.copytree(folders["deepseek_v3"], tmp_path / "mtp")
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    extra = {"model.layers.2.eh_proj.weight": torch.randn(64, 128),
             "model.layers.2.self_attn.kv_b_proj.weight": torch.randn(128, 32),
             "model.layers.2.mlp.experts.0.up_proj.weight": torch.randn(32, 64)}  # fmt: skip
    save_file(extra, folder / "mtp.safetensors")
    index["weight_map"].update(dict.fromkeys(extra, "mtp.safetensors"))
    index_file.write_text(json.dumps(index))
    assert set(extra) <= set(load_file(folder / "mtp.safetensors"))
    model = load_model(folder, "cpu")
    with torch.no_grad():
        assert (model(ids()) - hf_logits(folders["deepseek_v3"], ids())).abs().max() <= 1e-4


@pytest.mark.parametrize("case", CASES)
def test_cached_generation_equals_the_uncached_forward(folders, case):
    """A prompt, then 4 tokens one at a time through the KV cache (expanded keys and
    values), give the logits of one forward over the whole sequence."""
    from freetx.checkpoint import load_model

    model = load_model(folders[case], "cpu")
    tokens = ids()[:, :12]
    cache = model.new_cache(torch.zeros(2, dtype=torch.long), max_len=12)
    with torch.no_grad():
        steps = [model(tokens[:, :8], cache=cache)]
        steps += [model(tokens[:, i : i + 1], cache=cache) for i in range(8, 12)]
        full = model(tokens)
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5


@pytest.mark.slow  # three 2-process runs and an export, ~60 s on 2 CPU cores
def test_a_deepseek_v3_folder_finetunes_natively_on_2_processes_resumes_exactly_and_exports(
    tmp_path,
):
    folder, checkpoint = finetunes_and_resumes(tmp_path, "deepseek_v3", "native freetx decoder")
    out = exports_as_trained(tmp_path, folder, checkpoint)  # per-expert names, the router bias
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(stored(out)[bias], stored(folder)[bias])  # a buffer: not trained

"""Issue 41's matrix of MoE and hybrid architectures (tiny sharded folders transformers
wrote), its gaps closed here where other files do not cover them: LoRA with the experts
(all-linear, or attention and `experts`) on Qwen3.5, Qwen3.5-MoE, OLMoE, Qwen2-MoE, GLM-4.5
and DeepSeek-V3 (its MLA projections) exports to PEFT, and `peft.PeftModel.from_pretrained`
gives the merged folder's logits (and freetx's adapted model's); GPT-OSS (experts fused in
the folder) gives transformers' logits and HF -> DCP -> HF every stored tensor bit for bit.
Covered elsewhere: the logits and DCP round trips of the others (test_moe_folders,
test_deepseek_native_folders, test_hybrid_folders), LoRA on the experts of DeepSeek-V3,
Qwen2-MoE and GPT-OSS (test_expert_lora_folders), the 2-process fsdp resume of all 7
(tests/distributed/test_folder_resume.py).

Not all-linear on DeepSeek-V3 and GLM-4.5: PEFT 0.21.2, loading an adapter on a model type
transformers converts from per-expert tensors by Qwen2-MoE's pattern (deepseek_v3,
glm4_moe, olmoe, qwen3_moe), rewrites target_modules gate_proj / up_proj / down_proj into
the fused experts' target_parameters (transformers v4's names: its
`_convert_peft_config_moe`), so the dense layer's and shared experts' adapters are
dropped and gate_up_proj's rank doubled (a shape error on load)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.hf_folders import hf_logits, make_folder
from tests.recipes.test_expert_lora_folders import EXPERT_TARGETS, peft_round_trip
from tests.recipes.test_moe_folders import ids, stored

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
# family -> its LoRA targets: all-linear where PEFT 0.21 loads what it exports; DeepSeek-V3's
# and GLM-4.5's attention and experts (PEFT reads their dense and shared MLPs' gate_proj /
# up_proj / down_proj adapters as transformers v4's per-expert ones: see the module notes)
TARGETS = {"qwen3_5_text": ["all-linear"], "qwen3_5_moe_text": ["all-linear"],
           "olmoe": ["all-linear"], "qwen2_moe": ["all-linear"],
           "glm4_moe": [*ATTENTION, "experts"], "deepseek_v3": [*MLA, "experts"]}  # fmt: skip


@pytest.mark.parametrize("family", list(TARGETS))
def test_lora_with_the_experts_exports_to_peft_which_loads_it_with_the_merged_folders_logits(
    tmp_path, family
):
    folder = make_folder(tmp_path / family, family)
    diffs = peft_round_trip(tmp_path, folder, TARGETS[family], std=0.1)
    print(f"{family}: {diffs}")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    experts = None if family == "qwen3_5_text" else EXPERT_TARGETS  # a dense model
    assert config["target_parameters"] == experts
    assert "o_proj" in config["target_modules"]  # attention's output, beside the experts
    assert diffs["change"] > 1e-2  # the adapters change the logits
    assert diffs["peft"] <= 1e-4 and diffs["ours"] <= 1e-4, diffs


def test_a_gpt_oss_folder_gives_transformers_logits_and_back_bit_for_bit(tmp_path):
    """Its experts stored fused ([E, in, out], gate and up interleaved, with biases):
    nothing converted on load, nothing on export."""
    from freetx.checkpoint import convert, load_model

    folder = make_folder(tmp_path / "gpt_oss", "gpt_oss")
    assert len(list(folder.glob("*.safetensors"))) > 1  # sharded
    model = load_model(folder, "cpu")
    assert model.describe().startswith("generic transformers path for gpt_oss")
    with torch.no_grad():
        diff = (model(ids()) - hf_logits(folder, ids())).abs().max().item()
    print(f"gpt_oss: logits max diff vs transformers {diff:.2e}")
    assert diff <= 1e-4
    convert(folder, tmp_path / "dcp", to="dcp")
    convert(tmp_path / "dcp", tmp_path / "hf", to="hf", max_shard_size="40KB")
    before, after = stored(folder), stored(tmp_path / "hf")
    assert set(after) == set(before) and "model.layers.0.mlp.experts.gate_up_proj_bias" in before
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name


def test_a_peft_export_peft_would_load_otherwise_is_refused_by_name(tmp_path):
    """all-linear on DeepSeek-V3 adapts its dense layer's gate_proj / up_proj / down_proj,
    which PEFT would move onto the fused experts on load: the export is refused naming
    them and the fix, nothing written; the merge of the same adapters works."""
    from freetx.checkpoint import convert
    from freetx.checkpoint.adapters import LoRASettings, peft_moves_onto_experts
    from freetx.errors import CheckpointError
    from tests.recipes.test_expert_lora_folders import adapter_checkpoint

    assert peft_moves_onto_experts("qwen2_moe", ["gate_proj", "q_proj"]) == []
    assert peft_moves_onto_experts("glm4_moe", ["mlp.gate_proj", "q_proj"]) == ["mlp.gate_proj"]
    folder = make_folder(tmp_path / "deepseek_v3", "deepseek_v3")
    file = tmp_path / "adapters.safetensors"
    adapter_checkpoint(folder, file, ["all-linear"])
    with pytest.raises(CheckpointError) as refused:
        convert(file, tmp_path / "peft", to="peft", lora=LoRASettings(alpha=4.0))
    message = str(refused.value)
    assert "down_proj, gate_proj, up_proj of a deepseek_v3 adapter" in message
    assert "freetx checkpoint merge" in message and not (tmp_path / "peft").exists()

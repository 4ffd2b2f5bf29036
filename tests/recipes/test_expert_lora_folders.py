"""LoRA on MoE experts with tiny sharded folders transformers wrote: native Qwen3-MoE
(freetx's GroupedExperts) and the generic path's Qwen2-MoE, DeepSeek-V3 and GPT-OSS
(transformers' experts modules; GPT-OSS's stored transposed). The adapters export to PEFT's
format for expert parameters (`target_parameters`, PEFT 0.21's ParamWrapper keys and
layout), which `peft.PeftModel.from_pretrained` loads on transformers' model with the
logits of freetx's merged export (written under the folder's per-expert names) and of
freetx's own adapted model; a 2-process fsdp LoRA run on the experts through the CLI
resumes exactly and exports. QLoRA (the experts' bases in NF4): a folder loads into them
with the logits of the dequantized bases, and 2-process runs resume exactly and merge."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import one_paragraph, run_freetx, run_freetx_here
from tests.hf_folders import hf_logits, make_folder
from tests.unit.test_expert_lora import randomize_adapters, save_adapters

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SLOW = pytest.mark.slow
EXPERT_TARGETS = ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


def ids(seed=1):
    return torch.randint(3, 384, (2, 24), generator=torch.Generator().manual_seed(seed))


def adapter_checkpoint(folder, path, targets, std=0.3):
    """freetx's model of `folder` with LoRA (rank 2, alpha 4) on `targets`, its adapters
    random (as after training: N(0, std)), saved alone as a .safetensors file freetx reads
    back (`save_adapters`); returns the adapted model's logits."""
    from freetx.checkpoint.loading import load_initial_weights, source_model_on_meta
    from freetx.distributed import materialize
    from freetx.models.peft import apply_lora

    model = source_model_on_meta(str(folder))
    apply_lora(model, targets, rank=2, alpha=4)
    materialize(model, torch.device("cpu"), seed=0, init_weights=False)
    load_initial_weights(model, folder)
    randomize_adapters(model, std=std)
    save_adapters(model, path)
    with torch.no_grad():
        return model.eval()(ids())


def peft_tensors(folder):
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


def peft_round_trip(tmp_path, folder, targets, std=0.3) -> dict[str, float]:
    """freetx's LoRA on `targets` of `folder`'s model (random adapters of `std`) exported to PEFT
    (into tmp_path/peft) and merged into a folder under the stored names; returns the
    largest logit differences: "peft" (`PeftModel.from_pretrained` on transformers' model
    vs the merged folder), "ours" (freetx's adapted model vs the merged folder) and
    "change" (the merged folder vs the plain one)."""
    from freetx.checkpoint import convert
    from freetx.checkpoint.adapters import LoRASettings
    from freetx.checkpoint.convert import merge
    from tests.recipes.test_hf_finetune import tensor_names

    file = tmp_path / "adapters.safetensors"
    ours = adapter_checkpoint(folder, file, targets, std)
    lora = LoRASettings(alpha=4.0)
    convert(file, tmp_path / "peft", to="peft", lora=lora)
    merge(file, folder, tmp_path / "merged", lora=lora)
    assert tensor_names(tmp_path / "merged") == tensor_names(folder)  # per-expert names
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()(ids()).logits
        merged = hf_logits(tmp_path / "merged", ids())
        plain = hf_logits(folder, ids())
    return {"peft": (adapted - merged).abs().max().item(),
            "ours": (ours - merged).abs().max().item(),
            "change": (merged - plain).abs().max().item()}  # fmt: skip


@pytest.mark.parametrize(
    "family,targets",
    [("qwen3_moe", ["q", "experts"]),  # native: w1 and w3 exported as one gate_up_proj
     pytest.param("qwen2_moe", ["experts"], marks=SLOW),  # the experts alone
     ("deepseek_v3", ["o_proj", "experts"]),
     ("gpt_oss", ["all-linear"])],  # experts stored [E, in, out]; all-linear has them
)  # fmt: skip
def test_expert_adapters_export_to_peft_which_loads_them_with_the_merged_folders_logits(
    tmp_path, family, targets
):
    folder = make_folder(tmp_path / family, family)
    diffs = peft_round_trip(tmp_path, folder, targets)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_parameters"] == EXPERT_TARGETS and config["r"] == 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    moe = next(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
    prefix = f"base_model.model.model.layers.{moe}.mlp.experts."
    tensors = peft_tensors(tmp_path / "peft")
    hidden, rank_experts = hf.config.hidden_size, 2 * 4  # r * E
    assert tensors[prefix + "base_layer.lora_A.weight"].shape == (rank_experts, hidden)
    assert tensors[prefix + "base_layer.lora_B.weight"].shape[1] == rank_experts  # gate_up
    assert tensors[prefix + "lora_B.weight"].shape == (hidden, rank_experts)  # down_proj
    assert diffs["change"] > 1e-2  # the adapters change the logits
    assert diffs["peft"] <= 1e-4 and diffs["ours"] <= 1e-4, diffs


@pytest.mark.parametrize(
    "family,targets",
    [("qwen3_moe", ["experts"]),  # native: w1 / w3 / w2 stacked from per-expert tensors
     ("gpt_oss", ["all-linear"])],  # experts stored transposed; the Linears in NF4 too
)  # fmt: skip
def test_qlora_on_experts_loads_a_folder_into_nf4_bases_with_the_dequantized_bases_logits(
    tmp_path, family, targets
):
    """QLoRA's model of a folder (its experts' bases NF4 [E * rows, cols], read from the
    folder's [E, rows, cols] or per-expert tensors) computes the logits of the LoRA model
    whose bases are the NF4 ones dequantized."""
    pytest.importorskip("torchao")
    from freetx.checkpoint.loading import load_initial_weights, source_model_on_meta
    from freetx.distributed import materialize
    from freetx.models.peft import apply_lora
    from freetx.models.peft.experts import expert_adapter_layers
    from freetx.models.peft.nf4 import NF4LoRALinear, quantize_bases

    folder = make_folder(tmp_path / family, family)
    models = []
    for quantize in (True, False):
        model = source_model_on_meta(str(folder))
        apply_lora(model, targets, rank=2, alpha=4)
        if quantize:
            quantize_bases(model)
        materialize(model, torch.device("cpu"), seed=0, init_weights=False)
        load_initial_weights(model, folder)
        randomize_adapters(model)  # the same values in both
        models.append(model.eval())
    quantized, reference = models
    with torch.no_grad():
        plain = reference(ids())
        for name, experts in expert_adapter_layers(quantized).items():
            for param in experts.nf4_shapes:
                dense = experts.dequantized(param, torch.float32)
                reference.get_parameter(f"{name}.{param}").copy_(dense)
        for name, layer in quantized.named_modules():
            if isinstance(layer, NF4LoRALinear):
                reference.get_parameter(f"{name}.weight").copy_(layer.base_weight().float())
        ours = quantized(ids())
        assert (ours - plain).abs().max() > 1e-3  # NF4 moved the bases (0.077, 0.58 measured)
        assert torch.equal(ours, reference(ids()))  # fp32 on CPU: bit for bit


def experts_run(folder, output_dir, *overrides):
    """LoRA (rank 4) on `folder`'s o_proj and experts on 2 processes (fsdp) through the CLI,
    a checkpoint every 2 steps, the PEFT export at the end."""
    from tests.recipes.test_checkpoint_resume import COMMON

    return run_freetx(
        "run", "--nproc-per-node", "2", "lora_finetune_fsdp2", "--config", "llm/hf_tiny_lora",
        f"model_dir={folder}", f"output_dir={output_dir}", "peft.dropout=0", "peft.rank=4",
        "peft.target_modules=[o_proj,experts]", "optimizer.lr=0.02", "dataset.seq_len=64",
        "dataset.num_builtin_examples=400", "checkpoint.every_n_steps=2", *COMMON, *overrides,
    )  # fmt: skip


def resumes_exactly(tmp_path, folder, *overrides):
    """4 steps straight, and 2 + 2 resumed, give the same losses at steps 3 and 4; returns
    the straight run's folder and the banner's words for what it trains."""
    from tests.recipes.test_checkpoint_resume import losses

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = experts_run(folder, straight, "max_steps=4", *overrides)
    assert result.returncode == 0, result.stderr
    assert experts_run(folder, resumed, "max_steps=2", *overrides).returncode == 0
    again = experts_run(folder, resumed, "max_steps=4", *overrides)
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stderr
    a, b = losses(straight), losses(resumed)
    assert sorted(b) == [1, 2, 3, 4] and all(a[step] == b[step] for step in (3, 4)), (a, b)
    return straight, result.stdout


def merged_and_peft_logits(tmp_path, folder, straight):
    """(PEFT's model of the final export, `freetx checkpoint merge`'s folder of the last
    checkpoint, the folder itself): their logits."""
    checkpoint = straight / "checkpoints" / "step_000004"
    merged = run_freetx_here("checkpoint", "merge", str(checkpoint), "--base", str(folder),
                        str(tmp_path / "merged"))  # fmt: skip
    assert merged.returncode == 0, merged.stderr
    auto = transformers.AutoModelForCausalLM
    with torch.no_grad():
        exported = peft.PeftModel.from_pretrained(auto.from_pretrained(folder),
                                                  straight / "export" / "peft")  # fmt: skip
        return (exported.eval()(ids()).logits, hf_logits(tmp_path / "merged", ids()),
                hf_logits(folder, ids()))  # fmt: skip


@SLOW  # three 2-process runs, ~75 s on 2 CPU cores
def test_lora_on_deepseek_v3_experts_on_2_processes_resumes_exactly_and_exports_to_peft(tmp_path):
    from freetx.checkpoint import load_model
    from freetx.training.export import recorded_peft
    from tests.recipes.test_hf_finetune import tiny_folder

    folder = tiny_folder(tmp_path / "folder", "deepseek_v3")
    refused = experts_run(folder, tmp_path / "refused", "peft.dropout=0.1")  # config checks
    assert "'peft.dropout' is 0.1: LoRA on MoE experts" in one_paragraph(refused)
    assert not list((tmp_path / "refused").glob("checkpoints/step_*"))
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()
    straight, banner = resumes_exactly(tmp_path, folder)
    assert "trains LoRA r=4 alpha=32 on 3 modules" in banner  # 2 o_proj, 1 experts
    adapted, merged, plain = merged_and_peft_logits(tmp_path, folder, straight)
    checkpoint = straight / "checkpoints" / "step_000004"
    with torch.no_grad():
        ours = load_model(checkpoint, "cpu", adapters=recorded_peft(checkpoint))(ids())
    assert (adapted - plain).abs().max() > 1e-3  # the 4 steps trained
    assert (adapted - merged).abs().max() <= 1e-4
    assert (ours - merged).abs().max() <= 1e-4


@SLOW  # three 2-process runs, ~95 s on 2 CPU cores (one family: the slow tier's time;
# DeepSeek-V3's experts under LoRA are the test above's, NF4 experts of both paths the unit tests')
@pytest.mark.parametrize("family,modules", [("qwen3_moe", 5)])
def test_qlora_on_experts_on_2_processes_resumes_exactly_and_merges(tmp_path, family, modules):
    """The experts' bases (and o_proj's) in NF4, each rank holding its rows of the
    quantized whole, on native experts (Qwen3-MoE: 2 MoE layers and 3 o_proj); the adapters
    merge onto the folder's own bases (as QLoRA's on Linears do), and PEFT loads the
    export with the merged folder's logits."""
    from freetx.checkpoint import load_model
    from freetx.training.export import recorded_peft
    from tests.recipes.test_hf_finetune import tiny_folder

    folder = tiny_folder(tmp_path / "folder", family)
    straight, banner = resumes_exactly(tmp_path, folder, "peft.quantize_base=nf4")
    assert f"trains QLoRA r=4 alpha=32 on {modules} modules" in banner
    adapted, merged, plain = merged_and_peft_logits(tmp_path, folder, straight)
    assert (adapted - plain).abs().max() > 1e-3  # the 4 steps trained
    assert (adapted - merged).abs().max() <= 1e-4
    checkpoint = straight / "checkpoints" / "step_000004"
    with torch.no_grad():  # the run's own model: NF4 bases, so within NF4's error
        ours = load_model(checkpoint, "cpu", adapters=recorded_peft(checkpoint))(ids())
    # measured (deepseek_v3): 0.13 against the 4 steps' 1.46 (the merged folder: 3.9e-7)
    assert (ours - merged).abs().max() < 0.25 * (adapted - plain).abs().max()

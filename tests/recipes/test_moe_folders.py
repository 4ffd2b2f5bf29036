"""MoE folders whose experts transformers converts on load (stored one tensor per expert,
held stacked: Qwen2-MoE, OLMoE; DeepSeek-V3 and GLM-4.5, which freetx reads natively:
tests/recipes/test_deepseek_native_folders.py), read through the generic path by
transformers' own conversion rules (`freetx.models.hf_generic.ConvertedNames`): tiny
sharded folders transformers wrote give its logits through `load_model`, HF -> DCP -> HF
gives every stored tensor back bit for bit under its own name, a rank reads only its
rows of the experts, a rule freetx does not stream is refused by name before a weight is
read, and a 2-process fsdp fine-tune through the CLI resumes exactly and exports under
the folder's names."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import one_paragraph, run_freetx_here
from tests.hf_folders import CONVERTED_MOE_FAMILIES, hf_logits, make_folder

transformers = pytest.importorskip("transformers")

FAMILIES = list(CONVERTED_MOE_FAMILIES)
NATIVE = ("deepseek_v3", "glm4_moe")  # freetx.models.hf_families.FAMILIES reads these


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_folders")
    return {family: make_folder(root / family, family) for family in FAMILIES}


def ids(seed=1):
    return torch.randint(3, 384, (2, 24), generator=torch.Generator().manual_seed(seed))


def stored(folder):
    """Every tensor of an HF folder's safetensors files, by its stored name."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("family", FAMILIES)
def test_each_converted_moe_folder_gives_transformers_logits(folders, family):
    from freetx.checkpoint import load_model

    folder = folders[family]
    assert len(list(folder.glob("*.safetensors"))) > 1  # sharded: experts span files
    model = load_model(folder, "cpu")
    path = "native freetx decoder" if family in NATIVE else "generic transformers path"
    assert model.describe() == f"{path} for {family}"
    with torch.no_grad():
        assert (model(ids()) - hf_logits(folder, ids())).abs().max() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_dcp_to_hf_gives_each_stored_tensor_back_bit_for_bit(tmp_path, folders, family):
    from freetx.checkpoint import convert

    folder = folders[family]
    convert(folder, tmp_path / "dcp", to="dcp")
    convert(tmp_path / "dcp", tmp_path / "hf", to="hf", max_shard_size="40KB")
    before, after = stored(folder), stored(tmp_path / "hf")
    assert set(after) == set(before)  # the per-expert names, not the fused ones
    assert any(".experts.3." in name for name in before)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name


def test_a_rank_reads_only_its_rows_of_the_fused_experts(folders):
    """FSDP2 shards dim 0 (the experts): rows 1..2 of gate_up_proj are read as experts 1
    and 2's gate and up projections joined, equal to transformers' parameter."""
    from freetx.checkpoint.formats import open_tensors

    folder = folders["qwen2_moe"]
    source = open_tensors(folder)
    name = "model.model.layers.1.mlp.experts.gate_up_proj"
    full = source.get(name)
    rows = torch.empty(2, *full.shape[1:])
    source.read_into(name, slice(1, 3), rows)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert torch.equal(full, hf.model.layers[1].mlp.experts.gate_up_proj.detach())
    assert torch.equal(rows, full[1:3])
    gate, up = (
        stored(folder)[f"model.layers.1.mlp.experts.2.{p}_proj.weight"] for p in ("gate", "up")
    )
    assert torch.equal(rows[1], torch.cat([gate, up]))


def test_a_folder_missing_one_experts_up_projection_is_refused_naming_it(tmp_path, folders):
    import shutil

    from safetensors.torch import load_file, save_file

    from freetx.checkpoint.formats import open_tensors
    from freetx.errors import CheckpointError

    folder = shutil.copytree(folders["qwen2_moe"], tmp_path / "damaged")
    missing = "model.layers.1.mlp.experts.2.up_proj.weight"
    for file in folder.glob("*.safetensors"):
        tensors = load_file(file)
        if missing in tensors:
            save_file({k: v for k, v in tensors.items() if k != missing}, file)
    with pytest.raises(CheckpointError, match=r"lacks slices \[1\] of model\.layers\.1\.mlp"
                       r"\.experts\.gate_up_proj \(slice 2's parts\)"):  # fmt: skip
        open_tensors(folder)


def test_a_shard_of_no_rows_reads_nothing(folders):
    """Qwen2-MoE's shared_expert_gate is [1, H]: FSDP2 on 2 ranks gives the second none."""
    from freetx.checkpoint.formats import open_tensors

    source = open_tensors(folders["qwen2_moe"])
    name = "model.model.layers.0.mlp.shared_expert_gate.weight"
    assert source.infos[name].shape == (1, 64)
    source.read_into(name, slice(1, 1), torch.empty(0, 64))


def test_a_conversion_rule_freetx_does_not_stream_is_refused_by_name_before_any_weight_is_read(
    tmp_path,
):
    """HRM's rule splits a stored tensor (Chunk): refused naming it, with the weights file
    never opened (it is not even safetensors)."""
    folder = tmp_path / "hrm"
    folder.mkdir()
    config = transformers.AutoConfig.for_model("hrm_text").to_dict()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"not read")
    result = run_freetx_here("checkpoint", "convert", str(folder), str(tmp_path / "dcp"),
                             "--to", "dcp")  # fmt: skip
    message = one_paragraph(result)
    assert "transformers converts 'hrm_text' folders on load with WeightConverter" in message
    assert "Chunk(dim=0)" in message and "No native freetx layout reads 'hrm_text'" in message
    assert not (tmp_path / "dcp").exists()


def finetunes_and_resumes(tmp_path, family: str, path: str):
    """A tiny `family` folder fine-tuned on 2 processes under fsdp with full activation
    checkpointing (llm/hf_tiny_full), 4 steps straight and 2 then 2 resumed: the banner
    names the `path` ("native freetx decoder", "generic transformers path"), steps 3 and 4
    give the same losses; returns the folder and the resumed run's step-4 checkpoint."""
    from tests.recipes.test_checkpoint_resume import COMMON, losses
    from tests.recipes.test_hf_finetune import tiny_folder
    from tests.recipes.test_hf_generic_finetune import finetune

    folder = tiny_folder(tmp_path / "folder", family)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = finetune(folder, straight, "max_steps=4", "checkpoint.every_n_steps=2", *COMMON)
    assert f"| model: {path} for {family} |" in result.stdout
    finetune(folder, resumed, "max_steps=2", "checkpoint.every_n_steps=2", *COMMON)
    result = finetune(folder, resumed, "max_steps=4", "checkpoint.every_n_steps=2", *COMMON)
    assert "resumed from" in result.stdout and "(step 2," in result.stdout
    a, b = losses(straight), losses(resumed)
    assert sorted(b) == [1, 2, 3, 4] and all(a[step] == b[step] for step in (3, 4)), (a, b)
    return folder, resumed / "checkpoints" / "step_000004"


def exports_as_trained(tmp_path, folder, checkpoint):
    """`checkpoint` exported to an HF folder holds the source folder's tensor names (per
    expert) and gives freetx's logits of the checkpoint, which 4 steps moved; returns it."""
    from freetx.checkpoint import convert, load_model
    from tests.recipes.test_hf_finetune import tensor_names

    out = tmp_path / "exported"
    convert(checkpoint, out, to="hf")
    assert tensor_names(out) == tensor_names(folder)
    with torch.no_grad():
        trained = hf_logits(out, ids())
        assert (trained - load_model(checkpoint, "cpu")(ids())).abs().max() <= 1e-4
        assert (trained - hf_logits(folder, ids())).abs().max() > 1e-3  # the 4 steps trained
    return out


@pytest.mark.slow  # three 2-process runs and an export, ~60 s on 2 CPU cores
def test_a_qwen2_moe_folder_finetunes_on_2_processes_resumes_exactly_and_exports(tmp_path):
    folder, checkpoint = finetunes_and_resumes(tmp_path, "qwen2_moe", "generic transformers path")
    exports_as_trained(tmp_path, folder, checkpoint)  # per-expert names, the shared expert

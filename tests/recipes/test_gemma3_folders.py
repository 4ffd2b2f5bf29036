"""Gemma 3's multimodal folders (`gemma3`: Gemma3ForConditionalGeneration, the 4B-27B
checkpoints) through the CLI: read as their text model, converted to a `gemma3_text` folder
transformers loads with the same logits (the vision tower and projector named as not read),
and LoRA on the text model exported to adapters PEFT loads onto that folder."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import flat, hashes, run_freetx_here
from tests.hf_folders import hf_logits, make_folder
from tests.recipes.test_hf_finetune import lora_run, same_tensors, tensor_names, tiny_folder
from tests.unit.test_hf_models import load_freetx

transformers = pytest.importorskip("transformers")


def test_a_gemma3_folder_converts_to_its_text_model_with_the_same_logits(tmp_path):
    folder = make_folder(tmp_path / "gemma3", "gemma3")
    before = hashes(folder)
    out = tmp_path / "text"
    result = run_freetx_here("checkpoint", "convert", str(folder), str(out), "--to", "hf")
    assert result.returncode == 0, result.stderr
    stored = tensor_names(folder)
    vision = sum(n.startswith("vision_tower.") for n in stored)
    assert vision > 0 and "multi_modal_projector.mm_input_projection_weight" in stored
    said = flat(result.stdout)
    assert (
        f"Not read from {folder}: {vision + 2} tensors that are not weights of the model freetx "
        f"reads from it: "
        in said
        and f"vision_tower.* ({vision})" in said
        and "multi_modal_projector.* (2)" in said
    ), said
    assert (
        "It is a gemma3_text folder (Gemma3ForCausalLM): the text model of the gemma3 folder "
        f"{folder}, without its vision tower and projector." in said
    ), said
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["Gemma3ForCausalLM"], "gemma3_text")
    text_model = {n.removeprefix("language_model.") for n in stored if n.startswith("language_")}
    assert tensor_names(out) == text_model
    ids = torch.randint(0, 384, (2, 160), generator=torch.Generator().manual_seed(4))
    theirs = hf_logits(folder, ids)  # Gemma3ForConditionalGeneration on text alone
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(exported).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        assert (exported.eval()(ids).logits - theirs).abs().max() < 1e-4
        assert (load_freetx(folder)(ids) - theirs).abs().max() < 1e-4
    assert hashes(folder) == before


@pytest.mark.slow  # 5-15 s on 2 CPU cores: make test's budget
def test_lora_on_a_gemma3_folder_exports_adapters_peft_loads_onto_its_text_model(tmp_path):
    """LoRA on the text model of a gemma3 folder: the PEFT export is named for the text model
    (`gemma3_text`, Gemma3ForCausalLM), which `convert --to hf` writes; onto it, PEFT gives
    the logits of `checkpoint merge`'s folder (a gemma3_text folder too)."""
    peft = pytest.importorskip("peft")
    folder, run = tiny_folder(tmp_path, "gemma3"), tmp_path / "run"
    result = lora_run(folder, run)
    assert "native freetx decoder for gemma3_text" in result.stdout
    assert f"Not read from {folder}: " in result.stdout  # the vision tower, when loading
    assert f"The adapters are named for the text model of the gemma3 folder {folder}" in flat(
        result.stdout
    )
    adapter = json.loads((run / "export" / "peft" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] is None  # not the multimodal folder
    checkpoint = str(run / "checkpoints" / "step_000002")
    merged = run_freetx_here("checkpoint", "merge", checkpoint, "--base", str(folder),
                             str(tmp_path / "merged"))  # fmt: skip
    assert merged.returncode == 0, merged.stderr
    assert "It is a gemma3_text folder (Gemma3ForCausalLM)" in flat(merged.stdout)
    text = tmp_path / "text"
    assert (
        run_freetx_here("checkpoint", "convert", str(folder), str(text), "--to", "hf").returncode
        == 0
    )
    assert not same_tensors(text, tmp_path / "merged")  # the adapters are merged in
    ids = torch.randint(0, 259, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(text)
        adapted = peft.PeftModel.from_pretrained(base, run / "export" / "peft").eval()(ids).logits
        plain = hf_logits(folder, ids)
        merged_logits = hf_logits(tmp_path / "merged", ids)
        # on the multimodal model PEFT finds none of their modules: the base's logits
        multimodal = transformers.AutoModelForCausalLM.from_pretrained(folder)
        ignored = peft.PeftModel.from_pretrained(multimodal, run / "export" / "peft")
        assert torch.equal(ignored.eval()(ids).logits, plain)
    assert (adapted - plain).abs().max() > 1e-3  # the adapters changed something
    assert (adapted - merged_logits).abs().max() < 1e-4

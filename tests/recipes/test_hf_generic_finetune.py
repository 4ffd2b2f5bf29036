"""A folder of an architecture freetx has no native layout for (StarCoder2), through the
CLI: `llm/hf_tiny_full` fine-tunes it on 2 processes with FSDP2 per block and activation
checkpointing, the banner says it runs on the generic transformers path, the export loads
in transformers with freetx's logits, a resume is exact and `generate` samples from it,
and LoRA exports adapters PEFT loads."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import flat, one_paragraph, run_freetx, run_freetx_here, run_refused_here
from tests.hf_folders import RANDOM_WEIGHTS_LR, hf_logits
from tests.recipes.test_checkpoint_resume import COMMON, losses
from tests.recipes.test_hf_finetune import (
    JSONL,
    lora_export_loads_in_peft,
    tensor_names,
    tiny_folder,
)

transformers = pytest.importorskip("transformers")

SHORT = ["eval.max_batches=1", "dataset.num_builtin_examples=400"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("generic"), "starcoder2")


def finetune(folder, output_dir, *overrides):
    result = run_freetx(
        "run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config", "llm/hf_tiny_full",
        RANDOM_WEIGHTS_LR, f"model_dir={folder}", f"output_dir={output_dir}", "distributed.activation_checkpointing=full",
        *SHORT, *overrides,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.mark.slow  # 5-15 s on 2 CPU cores: make test's budget
def test_a_starcoder2_folder_finetunes_on_2_processes_and_exports(tmp_path, folder):
    from freetx.checkpoint import load_model

    run = tmp_path / "run"
    result = finetune(folder, run, "max_steps=2", "log_every_n_steps=1", JSONL)
    assert "| model: generic transformers path for starcoder2 |" in result.stdout
    assert f"initial weights from {folder}" in result.stdout
    checkpoint = run / "checkpoints" / "step_000002"
    out = tmp_path / "exported"
    converted = run_freetx_here("checkpoint", "convert", str(checkpoint), str(out), "--to", "hf")
    assert converted.returncode == 0, converted.stderr
    assert tensor_names(out) == tensor_names(folder)  # the folder's names, lm_head tied
    ids = torch.randint(0, 384, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        trained = hf_logits(out, ids)
        assert (trained - load_model(checkpoint, "cpu")(ids)).abs().max() < 1e-4
        assert (trained - hf_logits(folder, ids)).abs().max() > 1e-3  # the 2 steps trained


@pytest.mark.slow  # three 2-process runs and sampling, ~55 s
def test_a_resumed_generic_finetune_reproduces_the_uninterrupted_one_and_samples(tmp_path, folder):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    finetune(folder, straight, "max_steps=4", "checkpoint.every_n_steps=2", *COMMON)
    finetune(folder, resumed, "max_steps=2", "checkpoint.every_n_steps=2", *COMMON)
    result = finetune(folder, resumed, "max_steps=4", "checkpoint.every_n_steps=2", *COMMON)
    assert "resumed from" in result.stdout and "(step 2," in result.stdout
    a, b = losses(straight), losses(resumed)
    assert sorted(b) == [1, 2, 3, 4]
    assert all(a[step] == b[step] for step in (3, 4)), (a, b)
    sampled = run_freetx("run", "generate", "--config", "llm/hf_generate",
                         f"checkpoint={resumed}", f"tokenizer.path={folder}",
                         f"output_dir={tmp_path / 'gen'}", "max_new_tokens=4")  # fmt: skip
    assert sampled.returncode == 0, sampled.stderr
    samples = [json.loads(x) for x in (tmp_path / "gen" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all(s["prompt"].startswith("Reverse the word") for s in samples)


@pytest.mark.slow  # 5-15 s on 2 CPU cores: make test's budget
def test_lora_on_a_generic_folder_exports_adapters_that_peft_loads(tmp_path, folder):
    lora_export_loads_in_peft(tmp_path, folder, "peft.target_modules=[q_proj, v_proj]")


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_decoder_field_on_the_generic_path_is_refused_before_anything_is_built(
    tmp_path, folder, command
):
    """`freetx validate` and the checks before a run read the folder's model_type alone and
    check the model's keys against what the generic path takes."""
    recipe = ["full_finetune_fsdp2", "--config"] if command == "run" else ["validate"]
    result = (run_refused_here if command == "run" else run_freetx_here)(
        *recipe, "llm/hf_tiny_full", f"model_dir={folder}",
        f"output_dir={tmp_path / 'run'}", "model.num_layers=2",
    )  # fmt: skip
    message = flat(result.stdout + result.stderr)
    assert result.returncode == 1 and "Traceback" not in message, message
    assert (
        "freetx.models.hf_model takes no argument 'num_layers'; "
        f"{folder} holds a 'starcoder2' model, which freetx builds through the generic "
        "transformers path" in message
    ) and "it takes: path, hf_config, max_seq_len." in message
    assert not (tmp_path / "run").exists()  # nothing was built or written
    if command == "run":
        one_paragraph(result)
    else:  # the field it takes passes
        fine = run_freetx_here("validate", "llm/hf_tiny_full", f"model_dir={folder}",
                               "model.max_seq_len=64")  # fmt: skip
        assert fine.returncode == 0, fine.stdout + fine.stderr

"""Mixture-of-experts folders through the CLI: a Mixtral folder fine-tuned on 2 processes
(FSDP shards whole experts) resumes exactly, logs the router's aux loss, and exports to an
HF folder transformers loads with freetx's logits; LoRA on a Qwen3-MoE folder's attention
exports adapters PEFT loads; LoRA on the experts is refused."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import one_paragraph, run_freetx, run_freetx_here
from tests.hf_folders import RANDOM_WEIGHTS_LR
from tests.recipes.test_hf_finetune import (
    JSONL,
    load_checkpoint_as,
    lora_export_loads_in_peft,
    tensor_names,
    tiny_folder,
)

transformers = pytest.importorskip("transformers")


def finetune(folder, run, *overrides):
    result = run_freetx(
        "run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config", "llm/hf_tiny_full",
        RANDOM_WEIGHTS_LR, f"model_dir={folder}", f"output_dir={run}", "log_every_n_steps=1", "eval.max_batches=1",
        "eval.every_n_steps=0", "checkpoint.every_n_steps=2", "dataset.num_builtin_examples=400",
        JSONL, *overrides,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result


def records(run):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


@pytest.mark.slow
def test_a_mixtral_folder_finetunes_resumes_exactly_and_exports(tmp_path):
    folder = tiny_folder(tmp_path, "mixtral")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = finetune(folder, straight, "max_steps=4")
    assert "active parameters per token" in first.stdout  # 2 of 4 experts per token
    finetune(folder, resumed, "max_steps=2")
    again = finetune(folder, resumed, "max_steps=4")
    assert "resumed from" in again.stdout
    a, b = records(straight), records(resumed)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bit for bit after the resume
    assert [r["aux_loss"] for r in a] == [r["aux_loss"] for r in b]
    # k = 2 when perfectly balanced; the load is the busiest expert's share over the mean
    assert all(1.5 < r["aux_loss"] < 4.0 and r["expert_load_max"] >= 1.0 for r in a)

    out = tmp_path / "exported"
    checkpoint = straight / "checkpoints" / "step_000004"
    converted = run_freetx_here("checkpoint", "convert", str(checkpoint), str(out), "--to", "hf")
    assert converted.returncode == 0, converted.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4
    assert config["router_aux_loss_coef"] == 0.02  # the folder's coefficient, kept
    assert tensor_names(out) == tensor_names(folder)  # per-expert names, none more or fewer
    from tests.hf_folders import hf_logits

    ids = torch.randint(0, 384, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        trained = hf_logits(out, ids)
        assert (trained - load_checkpoint_as(out, checkpoint)(ids)).abs().max() < 1e-4
        assert (trained - hf_logits(folder, ids)).abs().max() > 1e-3  # the steps trained


@pytest.mark.slow  # 5-15 s on 2 CPU cores: make test's budget
def test_lora_on_a_qwen3_moe_folders_attention_exports_adapters_that_peft_loads(tmp_path):
    folder = tiny_folder(tmp_path, "qwen3_moe")
    refused = run_freetx(  # llm/hf_tiny_lora's targets include gate, up, down: the experts
        "run", "lora_finetune_fsdp2", "--config", "llm/hf_tiny_lora", f"model_dir={folder}",
        f"output_dir={tmp_path / 'refused'}",
    )  # fmt: skip
    assert "grouped tensor of all experts" in one_paragraph(refused)
    assert "peft.target_modules=[q,k,v,o]" in one_paragraph(refused)
    lora_export_loads_in_peft(tmp_path, folder, "peft.target_modules=[q,k,v,o]")
    assert "aux_loss" in records(tmp_path / "run")[-1]
    assert tensor_names(tmp_path / "merged") == tensor_names(folder)

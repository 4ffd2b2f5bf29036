"""A Phi-3 folder through the CLI: a 2-process FSDP fine-tune that resumes exactly and
exports an HF folder transformers loads with freetx's logits, and LoRA on the fused
qkv_proj / gate_up_proj exported to PEFT, which PEFT loads with the merged model's logits."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import flat, run_freetx, run_freetx_here
from tests.hf_folders import RANDOM_WEIGHTS_LR, hf_logits
from tests.recipes.test_hf_finetune import JSONL, load_checkpoint_as, tensor_names, tiny_folder

transformers = pytest.importorskip("transformers")

# constant LR after one warmup step: a run stopped at step 2 and resumed to 4 sees the LRs
# of a straight one; resid_pdrop's dropout on, so that its masks must resume too
COMMON = ["log_every_n_steps=1", "lr_schedule.warmup_steps=1", "lr_schedule.decay=constant",
          "eval.max_batches=1", "dataset.num_builtin_examples=400", "model.dropout=0.1",
          "checkpoint.every_n_steps=2", JSONL]  # fmt: skip


def finetune(folder, output_dir, steps):
    result = run_freetx(
        "run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config", "llm/hf_tiny_full",
        RANDOM_WEIGHTS_LR, f"model_dir={folder}", f"output_dir={output_dir}", f"max_steps={steps}", *COMMON,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return result, {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.slow  # three 2-process runs
def test_a_phi3_folder_finetunes_on_2_processes_resumes_exactly_and_exports(tmp_path):
    folder = tiny_folder(tmp_path, "phi3")
    _, straight = finetune(folder, tmp_path / "straight", 4)
    finetune(folder, tmp_path / "resumed", 2)
    result, resumed = finetune(folder, tmp_path / "resumed", 4)
    assert "resumed from" in result.stdout and "(step 2," in result.stdout
    for step in (3, 4):  # exact: same data, dropout masks and optimizer state
        assert straight[step] == resumed[step], (step, straight, resumed)

    checkpoint = tmp_path / "resumed" / "checkpoints" / "step_000004"
    out = tmp_path / "exported"
    converted = run_freetx_here("checkpoint", "convert", str(checkpoint), str(out), "--to", "hf")
    assert converted.returncode == 0, converted.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Phi3ForCausalLM"] and config["pad_token_id"] == 0
    assert tensor_names(out) == tensor_names(folder)  # qkv_proj, gate_up_proj: HF's names
    ids = torch.randint(0, 384, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        trained = hf_logits(out, ids)
        assert (trained - load_checkpoint_as(out, checkpoint)(ids)).abs().max() < 1e-4
        assert (trained - hf_logits(folder, ids)).abs().max() > 1e-3  # the 4 steps trained


def lora(folder, output_dir, *overrides):
    return run_freetx(
        "run", "lora_finetune_fsdp2", "--config", "llm/lora_tiny", f"model_dir={folder}",
        f"model={{_component_: freetx.models.hf_model, path: {folder}, "
        "max_seq_len: 128}", f"output_dir={output_dir}", "max_steps=2", "optimizer.lr=0.02",
        "lr_schedule.warmup_steps=0", "eval.max_batches=1", "dataset.num_builtin_examples=400",
        JSONL, *overrides,
    )  # fmt: skip


@pytest.mark.slow  # 5-15 s on 2 CPU cores: make test's budget
def test_lora_on_phi3s_fused_projections_exports_adapters_that_peft_loads(tmp_path):
    peft = pytest.importorskip("peft")
    folder = tiny_folder(tmp_path, "phi3")
    run = tmp_path / "run"
    result = lora(folder, run, "peft.target_modules=[qkv_proj,o_proj,gate_up_proj,down_proj]",
                  "checkpoint.final_export=peft")  # fmt: skip
    assert result.returncode == 0, result.stderr
    adapter = run / "export" / "peft"
    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert targets == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]  # PEFT's Phi-3 names
    merged = run_freetx_here("checkpoint", "merge", str(run / "checkpoints" / "step_000002"),
                        "--base", str(folder), str(tmp_path / "merged"))  # fmt: skip
    assert merged.returncode == 0, merged.stderr
    ids = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(folder)
        with_adapter = peft.PeftModel.from_pretrained(base, adapter).eval()(ids).logits
        plain = hf_logits(folder, ids)
        merged_logits = hf_logits(tmp_path / "merged", ids)
    assert (with_adapter - plain).abs().max() > 1e-3  # the adapters changed something
    assert (with_adapter - merged_logits).abs().max() < 1e-4


def test_lora_on_q_or_gate_of_a_fused_model_names_what_it_has(tmp_path):
    folder = tiny_folder(tmp_path, "phi3")
    result = lora(folder, tmp_path / "run")  # lora_tiny's targets: q, k, v, o, gate, up, down
    assert result.returncode == 1 and "Traceback" not in result.stderr
    message = flat(result.stderr)
    assert "peft target(s) 'q', 'k', 'v', 'gate', 'up' match no Linear module" in message
    assert (
        "Targets it knows: o, o_proj, down, down_proj, qkv, qkv_proj, gate_up, gate_up_proj, "
        "output, lm_head;" in message
    ), message
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))

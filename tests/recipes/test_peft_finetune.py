"""LoRA, DoRA, QLoRA and Spectrum through the CLI on 2 processes, on a base that llm/tiny
pretrained: the validation loss falls below the base's, checkpoints hold only what
trains, resume is exact, and the adapters export to PEFT (at the end of the run with
`checkpoint.final_export=peft`, and by `freetx checkpoint convert`) and merge into an HF
folder."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import flat, run_freetx, run_freetx_here

# ~80 s of 2-process runs: make test-slow (the fast tier keeps LoRA through the DPO and
# HF fine-tuning tests)
pytestmark = pytest.mark.slow

SHORT = ["max_steps=16", "log_every_n_steps=4", "eval.every_n_steps=0", "eval.max_batches=4",
         "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"]  # fmt: skip


def records(output_dir):
    return [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """llm/tiny pretrained for 40 steps (1 process), and the validation loss it starts from
    on the instruction data (a LoRA run with lr 0: a fresh adapter changes nothing)."""
    root = tmp_path_factory.mktemp("peft")
    result = run_freetx(
        "run", "full_finetune_fsdp2", "--config", "llm/tiny", f"output_dir={root / 'base'}",
        "max_steps=40", "eval.every_n_steps=0", "checkpoint.every_n_steps=0",
        "metric_loggers=[]",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    start = run_freetx(
        "run", "lora_finetune_fsdp2", "--config", "llm/lora_tiny", f"model_dir={root / 'base'}",
        f"output_dir={root / 'start'}", *SHORT, "max_steps=1", "optimizer.lr=0",
    )  # fmt: skip
    assert start.returncode == 0, start.stderr
    return root / "base", records(root / "start")[-1]["val/loss"]


def train(base_dir, output_dir, config, *overrides):
    result = run_freetx(
        "run", "--nproc-per-node", "2", "lora_finetune_fsdp2", "--config", config,
        f"model_dir={base_dir}", f"output_dir={output_dir}", *SHORT, *overrides,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result


SLOW = pytest.mark.slow  # the other methods: make test-slow


@pytest.mark.parametrize(
    "config,trains",
    [("llm/lora_tiny", "LoRA r=8"),
     pytest.param("llm/dora_tiny", "DoRA r=8", marks=SLOW),
     pytest.param("llm/qlora_tiny", "QLoRA r=8", marks=SLOW),
     pytest.param("llm/spectrum_tiny", "Spectrum: 7 modules", marks=SLOW)],
)  # fmt: skip
def test_each_method_lowers_the_validation_loss_of_the_base(tmp_path, base, config, trains):
    base_dir, start_loss = base
    if config == "llm/spectrum_tiny":
        scan = run_freetx("spectrum", "scan", str(base_dir), "--top-percent", "25")
        assert scan.returncode == 0, scan.stderr
    result = train(base_dir, tmp_path, config)
    assert trains in result.stdout
    final = records(tmp_path)[-1]["val/loss"]
    assert final < start_loss - 0.3, (final, start_loss)
    saved = run_freetx_here("checkpoint", "inspect", str(tmp_path / "checkpoints" / "step_000016"))
    tensors = [line.split()[0] for line in saved.stdout.splitlines() if line.startswith("model.")]
    if config == "llm/spectrum_tiny":
        assert len(tensors) == 8 and "model.tok_embeddings.weight" in tensors
    else:  # the adapters only: the base stays in llm/tiny's checkpoint
        assert tensors and all(".lora_" in t for t in tensors), tensors


@pytest.mark.slow  # 30 s
def test_lora_resume_is_exact(tmp_path, base):
    base_dir, _ = base
    options = ["log_every_n_steps=1", "checkpoint.every_n_steps=3", "lr_schedule.warmup_steps=0",
               "lr_schedule.decay=constant", "peft.dropout=0.1"]  # fmt: skip
    train(base_dir, tmp_path / "straight", "llm/lora_tiny", *options, "max_steps=6")
    train(base_dir, tmp_path / "resumed", "llm/lora_tiny", *options, "max_steps=3")
    result = train(base_dir, tmp_path / "resumed", "llm/lora_tiny", *options, "max_steps=6")
    assert "resumed from" in result.stdout
    losses = [{r["step"]: r["loss"] for r in records(tmp_path / d) if "loss" in r}
              for d in ("straight", "resumed")]  # fmt: skip
    for step in (4, 5, 6):
        assert losses[0][step] == losses[1][step], step


@pytest.mark.parametrize("config", ["llm/lora_tiny", pytest.param("llm/dora_tiny", marks=SLOW)])
def test_adapters_export_to_peft_and_merge_with_the_same_logits(tmp_path, base, config):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base_dir, _ = base
    result = train(base_dir, tmp_path / "run", config, "max_steps=4", "optimizer.lr=0.02",
                   "checkpoint.final_export=peft")  # fmt: skip
    assert "exported step_000004 as peft" in result.stdout
    ckpt = tmp_path / "run" / "checkpoints" / "step_000004"
    for args in (
        ["checkpoint", "convert", str(base_dir), str(tmp_path / "base_hf"), "--to", "hf"],
        ["checkpoint", "convert", str(ckpt), str(tmp_path / "adapter"), "--to", "peft"],
        ["checkpoint", "merge", str(ckpt), "--base", str(tmp_path / "base_hf"),
         str(tmp_path / "merged")],
    ):  # fmt: skip
        result = run_freetx(*args)
        assert result.returncode == 0, result.stderr
    config_json = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config_json["r"] == 8 and config_json["use_dora"] == (config == "llm/dora_tiny")
    ids = torch.randint(0, 259, (2, 48), generator=torch.Generator().manual_seed(0))
    auto = transformers.AutoModelForCausalLM
    with torch.no_grad():
        with_adapter = (
            peft.PeftModel.from_pretrained(
                auto.from_pretrained(tmp_path / "base_hf"), tmp_path / "adapter"
            )
            .eval()(ids)
            .logits
        )
        merged = auto.from_pretrained(tmp_path / "merged").eval()(ids).logits
        plain = auto.from_pretrained(tmp_path / "base_hf").eval()(ids).logits
        # the run's final export on a base that transformers' save_pretrained wrote
        auto.from_pretrained(tmp_path / "base_hf").save_pretrained(tmp_path / "base_saved")
        final = tmp_path / "run" / "export" / "peft"
        exported = peft.PeftModel.from_pretrained(
            auto.from_pretrained(tmp_path / "base_saved"), final
        )
        from_export = exported.eval()(ids).logits
    assert (with_adapter - plain).abs().max() > 1e-2  # the adapter changed something
    assert (with_adapter - merged).abs().max() < 1e-4
    assert torch.equal(from_export, with_adapter)
    for name in ("adapter_model.safetensors", "adapter_config.json"):  # the same bytes
        assert (final / name).read_bytes() == (tmp_path / "adapter" / name).read_bytes(), name


def test_bad_peft_input_is_one_paragraph(tmp_path, base):
    base_dir, _ = base
    cases = [
        (["peft.target_modules=[q,qq]"], "'qq' match no Linear module"),
        (["peft.rank=500"], "at most the smaller side"),
        (["peft.method=spectrum", "peft.spectrum_selection=/nope.yaml"], "does not exist"),
    ]
    for overrides, message in cases:
        result = run_freetx(
            "run", "lora_finetune_fsdp2", "--config", "llm/lora_tiny", f"model_dir={base_dir}",
            f"output_dir={tmp_path / 'x'}", *overrides,
        )  # fmt: skip
        assert result.returncode == 1 and message in flat(result.stderr), result.stderr
        assert "Traceback" not in result.stderr
    no_adapters = run_freetx_here("checkpoint", "convert", str(base_dir), str(tmp_path / "a"),
                             "--to", "peft")  # fmt: skip
    assert no_adapters.returncode == 1 and "holds no LoRA adapters" in flat(no_adapters.stderr)


@SLOW
def test_qlora_on_hsdp_and_a_merge_onto_another_base_are_refused(tmp_path, base):
    base_dir, _ = base
    hsdp = run_freetx(
        "run", "--nproc-per-node", "2", "lora_finetune_fsdp2", "--config", "llm/qlora_tiny",
        f"model_dir={base_dir}", f"output_dir={tmp_path / 'q'}", "distributed.strategy=hsdp",
        "distributed.replicate_degree=2", "max_steps=1",
    )  # fmt: skip
    assert hsdp.returncode == 1 and "1-D mesh only" in flat(hsdp.stderr), hsdp.stderr
    assert "Traceback" not in hsdp.stderr
    train(base_dir, tmp_path / "run", "llm/lora_tiny", "max_steps=2")
    other = run_freetx("run", "full_finetune_fsdp2", "--config", "llm/tiny",
                       f"output_dir={tmp_path / 'other'}", "max_steps=1", "model.hidden_dim=96",
                       "model.num_heads=3", "model.num_kv_heads=1", "eval.every_n_steps=0")  # fmt: skip
    assert other.returncode == 0, other.stderr
    merged = run_freetx_here("checkpoint", "merge", str(tmp_path / "run"), "--base",
                        str(tmp_path / "other"), str(tmp_path / "m"))  # fmt: skip
    assert merged.returncode == 1 and "a base of another shape" in flat(merged.stderr)
    assert not (tmp_path / "m").exists()

"""QAT runs of the SFT recipes through the CLI (tiny, 1 process): fake quantization trains
and changes the loss, `qat.start_step` leaves the steps before it the plain run's, resume is
exact with fake quantization on, and a QAT run (full or LoRA) converts to an HF folder that
transformers and freetx load with the logits of freetx's quantized model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from freetx.checkpoint import load_model
from freetx.models.qat import QuantScheme, quantize_ptq
from tests.conftest import run_freetx

pytestmark = pytest.mark.slow

SCHEME = "int8_dynamic_act_int4_weight"
IDS = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(0))
# constant LR after no warmup: a run stopped at step 2 and resumed to 4 sees the LRs of a
# straight one
SMALL = ["dataset.num_builtin_examples=400", "eval.every_n_steps=0", "eval.max_batches=1",
         "checkpoint.every_n_steps=0", "batch_size=8", "eval.batch_size=8",
         "log_every_n_steps=1", "lr_schedule.warmup_steps=0", "lr_schedule.decay=constant",
         "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"]  # fmt: skip


def losses(output_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def train(output_dir, *overrides, recipe="full_finetune_fsdp2", config="llm/instruct_tiny"):
    result = run_freetx("run", recipe, "--config", config, f"output_dir={output_dir}", *SMALL,
                        *overrides)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """3-step runs from the same seed: plain, and QAT (8da4w in groups of 64) from step 0."""
    root = tmp_path_factory.mktemp("qat")
    train(root / "plain", "max_steps=3")
    result = train(root / "qat", "max_steps=3", f"qat.scheme={SCHEME}", "qat.group_size=64")
    return root, result


def test_a_qat_run_trains_and_fake_quantization_changes_the_loss(runs):
    root, _ = runs
    plain, qat = losses(root / "plain"), losses(root / "qat")
    assert all(math.isfinite(v) for v in qat.values()) and sorted(qat) == [1, 2, 3]
    assert abs(qat[1] - plain[1]) > 1e-4  # the same weights and batch, fake-quantized


def test_steps_before_start_step_are_the_plain_runs(runs, tmp_path):
    root, _ = runs
    train(tmp_path, "max_steps=3", f"qat.scheme={SCHEME}", "qat.start_step=2")
    plain, late = losses(root / "plain"), losses(tmp_path)
    assert late[1] == plain[1] and late[2] == plain[2]
    assert abs(late[3] - plain[3]) > 1e-5


def test_a_resume_with_fake_quantization_on_is_exact(runs, tmp_path):
    root, _ = runs  # the straight run: the module's QAT run
    qat = [f"qat.scheme={SCHEME}", "qat.group_size=64"]
    train(tmp_path / "resumed", "max_steps=2", *qat)
    train(tmp_path / "resumed", "max_steps=3", *qat)
    assert losses(tmp_path / "resumed") == losses(root / "qat")


def test_a_qat_run_exports_at_its_end_and_converts_to_what_transformers_loads(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    root, result = runs
    assert "quantized (int8_dynamic_act_int4_weight, groups of 64)" in result.stdout
    converted = run_freetx("checkpoint", "convert", str(root / "qat"), str(tmp_path / "q"),
                           "--quantize", "8da4w")  # fmt: skip
    assert converted.returncode == 0, converted.stderr
    expected = quantize_ptq(load_model(root / "qat", torch.device("cpu")), QuantScheme(SCHEME, 64))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    with torch.no_grad():
        want = expected(IDS)
        for folder in (tmp_path / "q", root / "qat" / "export" / "quantized"):
            assert torch.allclose(load_model(folder, "cpu")(IDS), want, atol=1e-5, rtol=0)
        assert torch.allclose(theirs(IDS).logits, want, atol=1e-5, rtol=0)
    assert (tmp_path / "q" / "tokenizer.json").is_file()


def test_a_plain_run_converts_as_ptq_with_the_given_group_size(runs, tmp_path):
    root, _ = runs
    result = run_freetx("checkpoint", "convert", str(root / "plain"), str(tmp_path / "q"),
                        "--quantize", SCHEME, "--group-size", "64")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "in groups of 64" in result.stdout
    expected = quantize_ptq(
        load_model(root / "plain", torch.device("cpu")), QuantScheme(SCHEME, 64)
    )
    with torch.no_grad():
        got = load_model(tmp_path / "q", torch.device("cpu"))(IDS)
        assert torch.allclose(got, expected(IDS), atol=1e-5, rtol=0)


def test_the_group_size_defaults_to_the_qat_runs(runs, tmp_path):
    root, _ = runs  # trained in groups of 64 (the default is 32)
    result = run_freetx("checkpoint", "convert", str(root / "qat"), str(tmp_path / "q"),
                        "--quantize", SCHEME)  # fmt: skip
    assert result.returncode == 0 and "in groups of 64" in result.stdout, result.stderr


def test_a_lora_qat_run_trains_and_converts_with_its_adapters_merged(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    root, _ = runs
    result = train(tmp_path / "lora", "max_steps=2", f"model_dir={root / 'plain'}",
                   "model.max_seq_len=128", f"qat.scheme={SCHEME}", recipe="lora_finetune_fsdp2",
                   config="llm/lora_tiny")  # fmt: skip
    assert all(math.isfinite(v) for v in losses(tmp_path / "lora").values())
    assert "quantized (int8_dynamic_act_int4_weight" in result.stdout
    converted = run_freetx("checkpoint", "convert", str(tmp_path / "lora"), str(tmp_path / "q"),
                           "--quantize", SCHEME)  # fmt: skip
    assert converted.returncode == 0, converted.stderr
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    ours = load_model(tmp_path / "lora" / "export" / "quantized", torch.device("cpu"))
    with torch.no_grad():
        assert torch.allclose(theirs(IDS).logits, ours(IDS), atol=1e-5, rtol=0)
        plain = load_model(root / "plain", torch.device("cpu"))(IDS)
        assert not torch.allclose(ours(IDS), plain, atol=1e-2)  # adapters trained, merged


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine exports int4_weight")
def test_an_int4_weight_run_on_the_cpu_says_its_export_was_not_written(tmp_path):
    result = train(tmp_path, "max_steps=1", "qat.scheme=int4_weight")
    text = " ".join(result.stdout.split())
    assert "The quantized export was not written" in text and "on a CUDA machine" in text
    assert "--quantize int4_weight --group-size 32" in text and "Nothing is lost" in text
    assert not (tmp_path / "export" / "quantized").exists()


@pytest.mark.parametrize(
    "recipe, config", [("full_finetune_fsdp2", "llm/hf_tiny_full"),
                       ("lora_finetune_fsdp2", "llm/hf_tiny_lora")],
)  # fmt: skip
def test_an_hf_folder_trains_with_qat_on_2_processes_and_exports_what_transformers_loads(
    tmp_path, recipe, config
):
    from transformers import AutoModelForCausalLM

    from freetx.data.corpus import builtin_documents
    from tests.hf_folders import make_folder, make_tokenizer

    folder = make_folder(tmp_path / "llama", "llama3_2")
    make_tokenizer(folder, builtin_documents()[:20])
    run = tmp_path / "run"
    result = run_freetx(
        "run", "--nproc-per-node", "2", recipe, "--config", config, f"model_dir={folder}",
        f"output_dir={run}", "max_steps=2", "eval.every_n_steps=0", "eval.max_batches=1",
        "checkpoint.every_n_steps=0", f"qat.scheme={SCHEME}", "log_every_n_steps=1",
        "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"initial weights from {folder}" in result.stdout
    assert all(math.isfinite(v) for v in losses(run).values())
    export = run / "export" / "quantized"
    theirs = AutoModelForCausalLM.from_pretrained(export).eval()
    ids = IDS % theirs.config.vocab_size
    with torch.no_grad():
        ours = load_model(export, torch.device("cpu"))(ids)
        assert torch.allclose(theirs(ids).logits, ours, atol=1e-5, rtol=0)

"""What the decoder recipes' one setup (`freetx.training.decoder`) gives every recipe, from
the CLI on 2 processes: `qat.scheme` trains dpo_fsdp2 (full) and grpo_fsdp2 (LoRA) with fake
quantization and exports a quantized folder that transformers loads (its logits = freetx's of
the same folder; kd_fsdp2's: tests/recipes/test_kd.py); grpo_fsdp2 with
`eval.after_training` writes eval.json."""

from __future__ import annotations

import json
import math

import pytest
import torch

from freetx.checkpoint import load_model
from tests.conftest import run_freetx
from tests.recipes.test_dpo import hf_pairs  # noqa: F401  (fixtures)
from tests.recipes.test_eval import write_tasks
from tests.recipes.test_grpo import hf_prompts, user_env  # noqa: F401
from tests.slow.test_qat_runs import SCHEME

pytestmark = pytest.mark.slow

JSONL = "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"
SHORT = ["max_steps=2", "log_every_n_steps=1", "eval.every_n_steps=0", "eval.max_batches=1",
         "checkpoint.every_n_steps=0", f"qat.scheme={SCHEME}", JSONL]  # fmt: skip


def losses(out) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def assert_loads_as_freetx(export) -> None:
    """transformers loads the quantized folder, and computes freetx's logits of it."""
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(export).eval()
    ids = torch.arange(12).reshape(2, 6) % theirs.config.vocab_size
    with torch.no_grad():
        ours = load_model(export, torch.device("cpu"))(ids)
        assert torch.allclose(theirs(ids).logits, ours, atol=1e-5, rtol=0)


def run(out, recipe: str, config: str, *more: str, env=None):
    result = run_freetx("run", "--nproc-per-node", "2", recipe, "--config", config,
                        f"output_dir={out}", *SHORT, *more, env=env)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert all(math.isfinite(v) for v in losses(out).values()) and len(losses(out)) == 2
    assert "exported" in result.stdout and f"quantized ({SCHEME}" in result.stdout
    assert_loads_as_freetx(out / "export" / "quantized")
    return result


def test_dpo_trains_with_qat_and_exports_quantized(tmp_path, hf_pairs):  # noqa: F811
    folder, pairs = hf_pairs
    run(tmp_path / "dpo", "dpo_fsdp2", "llm/hf_tiny_dpo", f"model_dir={folder}",
        f"dataset.source={pairs}", "~peft", "checkpoint.final_export=null",
        "batch_size=4", "eval.batch_size=4")  # fmt: skip


def test_grpo_trains_with_qat_exports_quantized_and_scores_tasks_after_training(
    tmp_path,
    hf_prompts,  # noqa: F811
):
    pytest.importorskip("lm_eval")
    folder, prompts, user = hf_prompts
    tasks = write_tasks(tmp_path / "tasks")
    out = tmp_path / "grpo"
    result = run(out, "grpo_fsdp2", "llm/hf_tiny_grpo", f"model_dir={folder}",
                 f"dataset.source={prompts}", "rewards=[{_component_: my_rewards.count_words}]",
                 "dataset.val_fraction=0.2", "batch_size=2", "generation.num_generations=4",
                 "generation.max_completion_length=8", "eval.batch_size=2",
                 "eval.after_training=true", "eval.tasks=[freetx_tiny_mc]",
                 f"eval.include_path={tasks}", env=user_env(user))  # fmt: skip
    after = json.loads((out / "eval.json").read_text())
    assert "freetx_tiny_mc" in after["tasks"] and "freetx_tiny_mc" in result.stdout
    assert after["evaluated"]["tasks"] == ["freetx_tiny_mc"]

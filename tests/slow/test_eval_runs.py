"""The eval recipe against what it must equal, on a tiny HF folder transformers wrote and
local lm-eval tasks (tests/recipes/test_eval.py's): lm-eval's own HF backend (HFLM) on the
same folder, and on a folder whose tokenizer adds no BOS; a freetx run folder (perplexity = the run's own val/loss); a LoRA run's
adapters unmerged (= its merged folder); 2 processes (= 1); `eval.after_training` at the
end of an SFT run on 1 process and on 2 FSDP2 processes (= the recipe on its checkpoint);
an unknown task refused before any weight is read; a quantized export (PTQ) as HFLM
scores it."""

from __future__ import annotations

import json

import pytest

from tests.conftest import one_paragraph, run_freetx, run_freetx_here
from tests.recipes.test_eval import PROMPTS, TASKS, evaluate, write_tasks
from tests.unit.test_harness import MAX_LENGTH, tiny_folder

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

JSONL = "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"
SFT_DATA = ["dataset.num_builtin_examples=100", "dataset.seq_len=64"]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama 3.2 folder (spread weights, a tokenizer that writes BOS)."""
    return tiny_folder(tmp_path_factory.mktemp("llama"), "llama3_2")


def hflm_scores(folder, tasks) -> dict:
    """lm-eval's own HF backend on the folder and tasks."""
    from lm_eval.models.huggingface import HFLM

    from freetx.evaluation import evaluate_tasks

    hf = HFLM(pretrained=str(folder), batch_size=3, max_length=MAX_LENGTH, device="cpu",
              dtype="float32")  # fmt: skip
    return evaluate_tasks(hf, TASKS, include_path=str(tasks))


def assert_scores_equal(mine: dict, theirs: dict, rel: float = 1e-4) -> None:
    """Accuracies and exact matches identical, log-likelihood figures within `rel`."""
    for task, metric in [("freetx_tiny_mc", "acc"), ("freetx_tiny_mc", "acc_norm"),
                         ("freetx_tiny_gen", "exact_match")]:  # fmt: skip
        assert mine[task][metric] == theirs[task][metric], (task, metric)
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert mine["freetx_tiny_ppl"][metric] == pytest.approx(
            theirs["freetx_tiny_ppl"][metric], rel=rel
        )


def train(recipe: str, config: str, folder, out, *more: str, processes: int = 1):
    """A short run of a recipe on the folder; its result."""
    launch = ["--nproc-per-node", str(processes)] if processes > 1 else []
    result = run_freetx(
        "run", *launch, recipe, "--config", config, f"model_dir={folder}", f"output_dir={out}",
        "max_steps=3", "batch_size=4", "eval.batch_size=4", "eval.max_batches=null", JSONL,
        *SFT_DATA, *more,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_the_eval_recipe_scores_as_lm_evals_hf_backend(folder, tasks, tmp_path):
    result, results = evaluate(
        str(folder), "--tasks", ",".join(TASKS), "--include-path", str(tasks),
        f"output_dir={tmp_path}", "batch_size=3", f"max_length={MAX_LENGTH}",
    )  # fmt: skip
    assert_scores_equal(results["tasks"], hflm_scores(folder, tasks))
    assert results["checkpoint"] == str(folder) and results["evaluated"]["tasks"] == TASKS
    assert any("freetx_tiny_ppl" in line and "bits_per_byte" in line
               for line in result.stdout.splitlines())  # the table  # fmt: skip


def test_a_tokenizer_that_adds_no_bos_scores_as_lm_evals_hf_backend(tasks, tmp_path):
    """SmolLM2's kind of folder: its tokenizer names a BOS and adds none (no add_bos_token in
    its config, a post-processor without BOS). The eval recipe scores every kind of request
    as `lm_eval --model hf` does: choices, greedy generations, rolling perplexity (5 s)."""
    folder = tiny_folder(tmp_path / "llama", "llama3_2", bos=False)
    _, results = evaluate(
        str(folder), "--tasks", ",".join(TASKS), "--include-path", str(tasks),
        f"output_dir={tmp_path / 'out'}", "batch_size=3", f"max_length={MAX_LENGTH}",
    )  # fmt: skip
    assert_scores_equal(results["tasks"], hflm_scores(folder, tasks))


def test_a_run_folders_perplexity_equals_its_own_val_loss(folder, tmp_path):
    out = tmp_path / "sft"
    train("full_finetune_fsdp2", "llm/hf_tiny_full", folder, out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val_loss = [r["val/loss"] for r in records if "val/loss" in r][-1]
    _, results = evaluate(
        str(out), f"output_dir={tmp_path / 'eval'}", "dataset.source=builtin", *SFT_DATA,
        "batch_size=3",
    )  # fmt: skip
    assert results["dataset"]["loss"] == pytest.approx(val_loss, abs=1e-5)


def test_a_lora_run_evaluates_without_a_merge_as_its_merged_model(folder, tasks, tmp_path):
    out = tmp_path / "lora"
    train("lora_finetune_fsdp2", "llm/hf_tiny_lora", folder, out, "optimizer.lr=0.05",
          "checkpoint.final_export=null")  # fmt: skip
    merged = tmp_path / "merged"
    assert run_freetx_here("checkpoint", "merge", str(out), "--base", str(folder),
                           str(merged)).returncode == 0  # fmt: skip
    common = ["--tasks", ",".join(TASKS), "--include-path", str(tasks), "batch_size=3",
              f"max_length={MAX_LENGTH}", "dataset.source=builtin", *SFT_DATA]  # fmt: skip
    result, lora = evaluate(str(out), f"output_dir={tmp_path / 'a'}", *common)
    _, whole = evaluate(str(merged), f"output_dir={tmp_path / 'b'}", *common)
    _, base = evaluate(str(folder), f"output_dir={tmp_path / 'c'}", *common)
    assert "with its lora adapters (unmerged)" in result.stdout
    assert_scores_equal(lora["tasks"], whole["tasks"], rel=1e-5)
    assert lora["dataset"]["loss"] == pytest.approx(whole["dataset"]["loss"], abs=1e-5)
    assert abs(lora["dataset"]["loss"] - base["dataset"]["loss"]) > 1e-3  # the adapters count


def test_two_processes_give_the_scores_of_one(folder, tasks, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    text = tasks / "ppl.jsonl"
    common = [
        str(folder), "--tasks", ",".join(TASKS), "--include-path", str(tasks), "batch_size=2",
        f"max_length={MAX_LENGTH}", "max_new_tokens=6",
        "dataset._component_=freetx.data.PackedTextDataset", f"dataset.source={text}",
        f"dataset.validation_source={text}", "dataset.seq_len=16", "~dataset.val_fraction",
        f"prompts.source={prompts}", f"prompts.validation_source={prompts}",
        "rewards=[{_component_: freetx.objectives.ExactMatch}]",
    ]  # fmt: skip
    _, one = evaluate(*common, f"output_dir={tmp_path / 'one'}")
    result = run_freetx("eval", "--nproc-per-node", "2", *common, f"output_dir={tmp_path / 'two'}")
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "eval.json").read_text())
    assert "2 process(es)" in result.stdout
    assert_scores_equal(two["tasks"], one["tasks"], rel=1e-5)
    assert two["dataset"]["tokens"] == one["dataset"]["tokens"]
    assert two["dataset"]["loss"] == pytest.approx(one["dataset"]["loss"], abs=1e-5)
    assert two["rewards"] == pytest.approx(one["rewards"])


@pytest.mark.parametrize("processes", [1, 2])
def test_after_training_writes_the_eval_recipes_scores_at_the_end_of_an_sft_run(
    folder,
    tasks,
    tmp_path,
    processes,
):
    """On 2 processes the model is FSDP2-sharded: gathered once for the harness."""
    out = tmp_path / "sft"
    names = "[freetx_tiny_mc,freetx_tiny_ppl]"
    result = train("full_finetune_fsdp2", "llm/hf_tiny_full", folder, out,
                   "eval.after_training=true", f"eval.tasks={names}",
                   f"eval.include_path={tasks}", processes=processes)  # fmt: skip
    after = json.loads((out / "eval.json").read_text())
    assert "freetx_tiny_mc" in result.stdout  # the table
    _, recipe = evaluate(str(out), "--tasks", names[1:-1], "--include-path", str(tasks),
                         f"output_dir={tmp_path / 'eval'}")  # fmt: skip
    assert after["evaluated"] == recipe["evaluated"]
    assert after["tasks"]["freetx_tiny_mc"] == recipe["tasks"]["freetx_tiny_mc"]
    for metric, value in recipe["tasks"]["freetx_tiny_ppl"].items():
        assert after["tasks"]["freetx_tiny_ppl"][metric] == pytest.approx(value, rel=1e-5)


def test_an_unknown_task_is_refused_before_loading_weights(folder, tasks, tmp_path):
    result = run_freetx_here("eval", str(folder), "--tasks", "freetx_no_such_task",
                             "--include-path", str(tasks), f"output_dir={tmp_path}")  # fmt: skip
    text = one_paragraph(result)
    assert "'freetx_no_such_task'" in text and "include_path=" in text
    assert "eval |" not in result.stdout  # the banner that follows loading the model


def test_a_quantized_export_evaluates_as_lm_evals_hf_backend_on_it(folder, tasks, tmp_path):
    """`freetx checkpoint convert --quantize 8da4w` (PTQ) of the folder, evaluated: the
    scores transformers' load of the same quantized folder gets through HFLM."""
    quantized = tmp_path / "quantized"
    made = run_freetx_here("checkpoint", "convert", str(folder), str(quantized),
                           "--quantize", "8da4w")  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    _, results = evaluate(
        str(quantized), "--tasks", ",".join(TASKS), "--include-path", str(tasks),
        f"output_dir={tmp_path / 'eval'}", "batch_size=3", f"max_length={MAX_LENGTH}",
    )  # fmt: skip
    assert_scores_equal(results["tasks"], hflm_scores(quantized, tasks), rel=1e-3)
    _, plain = evaluate(
        str(folder), "--tasks", "freetx_tiny_ppl", "--include-path", str(tasks),
        f"output_dir={tmp_path / 'plain'}", "batch_size=3", f"max_length={MAX_LENGTH}",
    )  # fmt: skip
    ppl = "freetx_tiny_ppl"
    assert results["tasks"][ppl]["bits_per_byte"] != plain["tasks"][ppl]["bits_per_byte"]

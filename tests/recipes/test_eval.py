"""The eval recipe and `freetx eval` on a tiny HF folder transformers wrote and local
lm-eval tasks: tasks, perplexity of a dataset and rewards over greedy completions in one
run, and every refusal before a weight is read. The runs (lm-eval's own HF backend on the
same folder, a run folder, a LoRA run, 2 processes, `eval.after_training`):
tests/slow/test_eval_runs.py."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import flat, one_paragraph, run_freetx_here
from tests.unit.test_harness import GEN_ROWS, GEN_TASK, MC_ROWS, MC_TASK, TEXTS
from tests.unit.test_harness import tiny_folder as harness_folder

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

PPL_TASK = """task: freetx_tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
TASKS = ["freetx_tiny_mc", "freetx_tiny_gen", "freetx_tiny_ppl"]
PROMPTS = [{"prompt": "the cat sat on", "answer": "the mat"},
           {"prompt": "is the sky blue?", "answer": "yes"},
           {"prompt": "a dog ran", "answer": "in the park"}]  # fmt: skip


def completion_tokens(prompt: str, completion: str, row: dict) -> float:
    """A reward that is the completion's length in tokens (the row's field the recipe sets)."""
    return float(row["completion_tokens"])


def write_tasks(root):
    """A folder of three local task YAMLs (multiple choice, generation, rolling
    log-likelihood), their rows in local jsonl files; and a text file of TEXTS."""
    root.mkdir(parents=True, exist_ok=True)
    texts = [{"text": " ".join(TEXTS[i:] + TEXTS[:i])} for i in range(len(TEXTS))]
    for name, rows, task in [("mc", MC_ROWS, MC_TASK), ("gen", GEN_ROWS, GEN_TASK),
                             ("ppl", texts, PPL_TASK)]:  # fmt: skip
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (root / f"{name}.yaml").write_text(task.format(data=data))
    return root


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama 3.2 folder (spread weights, a tokenizer that writes BOS)."""
    return harness_folder(tmp_path_factory.mktemp("llama"), "llama3_2")


def evaluate(*args: str) -> tuple[object, dict]:
    """`freetx eval ARGS` in this process: the result and its eval.json."""
    out = next(a.split("=", 1)[1] for a in args if a.startswith("output_dir="))
    result = run_freetx_here("eval", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(f"{out}/eval.json") as file:
        return result, json.load(file)


def test_tasks_perplexity_of_a_dataset_and_rewards_over_greedy_completions(folder, tasks, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    text = tasks / "ppl.jsonl"
    result, results = evaluate(
        str(folder), "--tasks", "freetx_tiny_mc", "--include-path", str(tasks),
        "--trust", "tests.recipes.test_eval", f"output_dir={tmp_path / 'eval'}",
        "batch_size=2", "max_new_tokens=6",
        "dataset._component_=freetx.data.PackedTextDataset", f"dataset.source={text}",
        f"dataset.validation_source={text}", "dataset.seq_len=16", "~dataset.val_fraction",
        f"prompts.source={prompts}", f"prompts.validation_source={prompts}",
        "rewards=[{_component_: tests.recipes.test_eval.completion_tokens}]",
    )  # fmt: skip
    dataset, rewards = results["dataset"], results["rewards"]
    assert dataset["tokens"] > 16 and dataset["perplexity"] == pytest.approx(
        2.718281828 ** dataset["loss"]
    )
    assert results["evaluated"]["dataset"]["source"] == str(text)
    assert 0 < rewards["completions/mean_length"] <= 6
    assert rewards["rewards/completion_tokens/mean"] == pytest.approx(
        rewards["completions/mean_length"]
    )
    assert rewards["reward"] == pytest.approx(rewards["completions/mean_length"])  # weight 1
    assert 0 <= results["tasks"]["freetx_tiny_mc"]["acc"] <= 1
    table = [line.split() for line in result.stdout.splitlines()]
    assert ["dataset", "perplexity", f"{dataset['perplexity']:.4f}"] in table
    assert [
        "rewards",
        "completions/mean_length",
        f"{rewards['completions/mean_length']:.4f}",
    ] in table


def test_nothing_to_evaluate_is_refused_with_the_fix(folder, tmp_path):
    text = one_paragraph(run_freetx_here("eval", str(folder), f"output_dir={tmp_path}"))
    assert "nothing to evaluate" in text and "--tasks a,b" in text and "dataset.source=" in text


def test_a_missing_lm_eval_is_refused_before_loading_weights(folder, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    result = run_freetx_here("eval", str(folder), "--tasks", "x", f"output_dir={tmp_path}")
    assert "pip install 'freetx[eval]'" in one_paragraph(result)
    assert "eval |" not in result.stdout  # the banner that follows loading the model


def test_an_include_path_that_is_no_folder_is_refused(folder, tmp_path):
    result = run_freetx_here("eval", str(folder), "--tasks", "x", "--include-path",
                             str(tmp_path / "nothing"), f"output_dir={tmp_path}")  # fmt: skip
    assert "is not a folder" in one_paragraph(result)


def test_a_missing_checkpoint_is_refused(tmp_path):
    result = run_freetx_here("eval", str(tmp_path / "nothing"), "--tasks", "x",
                             f"output_dir={tmp_path}")  # fmt: skip
    assert f"checkpoint={tmp_path / 'nothing'} does not exist" in one_paragraph(result)


def test_a_checkpoint_without_a_tokenizer_is_refused(folder, tasks, tmp_path):
    bare = tmp_path / "model.safetensors"
    bare.write_bytes((folder / "model.safetensors").read_bytes())
    result = run_freetx_here("eval", str(bare), "--tasks", "freetx_tiny_mc", "--include-path",
                             str(tasks), f"output_dir={tmp_path / 'out'}")  # fmt: skip
    assert "tokenizer.path=MODEL_FOLDER" in one_paragraph(result)


def test_sequences_longer_than_the_models_positions_are_refused(folder, tmp_path):
    chat = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cat sat"}]
    chat.write_text(json.dumps({"messages": turns}) + "\n")
    result = run_freetx_here("eval", str(folder), f"output_dir={tmp_path / 'out'}",
                             f"dataset.source={chat}", f"dataset.validation_source={chat}",
                             "~dataset.val_fraction", "dataset.seq_len=100000")  # fmt: skip
    assert "dataset.seq_len=100000 is longer than the model's max_seq_len=" in one_paragraph(result)


def test_rewards_without_prompts_are_refused(folder, tmp_path):
    result = run_freetx_here("eval", str(folder), f"output_dir={tmp_path}",
                             "rewards=[{_component_: freetx.objectives.ExactMatch}]")  # fmt: skip
    assert "prompts.source=FILE" in one_paragraph(result)


def test_after_training_without_tasks_is_refused(tmp_path):
    result = run_freetx_here("validate", "llm/tiny", "eval.after_training=true")
    assert result.returncode == 1
    assert "'eval.after_training' is True" in flat(result.stdout)
    assert "set eval.tasks=[TASK, ...]" in flat(result.stdout)


def test_freetx_eval_is_the_short_form_of_run_eval():
    from freetx.cli.evaluate import build_parser, run_arguments

    args = build_parser().parse_intermixed_args(
        ["runs/x", "limit=5", "--tasks", "a, b", "--include-path", "t", "--nproc-per-node", "2"]
    )
    assert run_arguments(args) == [
        "--nproc-per-node", "2", "eval", "--config", "llm/hf_eval", "checkpoint=runs/x",
        "tasks=[a,b]", "include_path=t", "limit=5",
    ]  # fmt: skip


def test_no_checkpoint_is_refused():
    assert "checkpoint" in flat(run_freetx_here("validate", "llm/hf_eval").stdout)
    assert "CHECKPOINT" in one_paragraph(run_freetx_here("eval"), code=2)  # argparse's usage

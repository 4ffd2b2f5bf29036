"""Issue 36, the run folder: a folder knows which recipe made it (another recipe on it is
refused with the fix), `freetx cp` gives a copied config its own output_dir, a rerun with
nothing left to train says so last and logs nothing again, and a data file rewritten with
the same bytes is the same input."""

from __future__ import annotations

import json
import os

import pytest

from freetx.checkpoint.run_folder import (
    RECIPE_FILE,
    RecipeMark,
    check_recipe,
    nothing_left_to_train,
)
from freetx.errors import CheckpointError
from tests.conftest import REPO, flat, run_freetx, run_freetx_here

# -- a run folder knows which recipe made it ------------------------------------------


def test_another_recipe_on_a_run_folder_is_refused_with_the_fix(tmp_path):
    RecipeMark("full_finetune_fsdp2").write(tmp_path)
    with pytest.raises(CheckpointError) as refused:
        check_recipe(tmp_path, RecipeMark("lora_finetune_fsdp2"), "auto", False)
    message = flat(str(refused.value))
    assert f"output_dir {tmp_path} holds a run of full_finetune_fsdp2" in message
    assert "this run's recipe is lora_finetune_fsdp2" in message
    assert f"output_dir={tmp_path}_lora_finetune_fsdp2" in message
    assert "run the recipe that made it (full_finetune_fsdp2)" in message


def test_a_copied_recipe_on_a_built_in_recipes_folder_is_refused(tmp_path):
    RecipeMark("full_finetune_fsdp2").write(tmp_path)
    copy = RecipeMark("full_finetune_fsdp2", str(tmp_path / "my_ft.py"))
    with pytest.raises(CheckpointError) as refused:
        check_recipe(tmp_path, copy, "auto", False)
    message = flat(str(refused.value))
    assert "my_ft.py (a recipe file, its runs named full_finetune_fsdp2)" in message
    assert f"output_dir={tmp_path}_my_ft" in message


def test_the_recipe_that_made_a_folder_continues_it(tmp_path):
    check_recipe(tmp_path, RecipeMark("ad_ddp"), "auto", False)  # a new folder: no mark
    RecipeMark("ad_ddp").write(tmp_path)
    check_recipe(tmp_path, RecipeMark("ad_ddp"), "auto", False)
    assert json.loads((tmp_path / RECIPE_FILE).read_text()) == {"recipe": "ad_ddp", "file": None}


def test_starting_over_in_another_recipes_folder_with_overwrite_is_allowed(tmp_path):
    RecipeMark("full_finetune_fsdp2").write(tmp_path)
    check_recipe(tmp_path, RecipeMark("ad_ddp"), "never", True)


def test_a_built_in_recipe_file_is_marked_by_name_and_a_copy_by_path(tmp_path):
    from freetx.registry import get_recipe, recipe_file
    from freetx.training.lifecycle import recipe_mark

    built_in = recipe_file(get_recipe("full_finetune_fsdp2"))
    assert recipe_mark("full_finetune_fsdp2", built_in) == RecipeMark("full_finetune_fsdp2")
    copy = tmp_path / "my_ft.py"
    assert recipe_mark("full_finetune_fsdp2", copy).file == str(copy.resolve())


# -- freetx cp: a copied config gets its own output_dir ----------------------------------


def test_cp_gives_a_copied_config_an_output_dir_named_after_the_copy(tmp_path):
    dest = tmp_path / "my.yaml"
    result = run_freetx_here("cp", "llm/tiny", str(dest))
    assert result.returncode == 0, result.stderr
    assert "with output_dir: runs/my (named after the copy" in result.stdout
    original = (REPO / "recipe_configs" / "llm" / "tiny.yaml").read_text()
    assert dest.read_text() == original.replace("output_dir: runs/llm_tiny", "output_dir: runs/my")
    assert "# hardware: 2 CPU processes" in dest.read_text()  # the comments kept


def test_cp_keeps_a_comment_after_the_output_dir():
    from pathlib import Path

    from freetx.cli.cp import own_output_dir

    text = "seed: 0\noutput_dir: runs/x   # where it goes\nmodel:\n  output_dir: inner\n"
    copied, value = own_output_dir(text, Path("a/b/exp1.yaml"))
    assert value == "runs/exp1"
    assert (
        copied == "seed: 0\noutput_dir: runs/exp1   # where it goes\nmodel:\n  output_dir: inner\n"
    )
    assert own_output_dir("seed: 0\n", Path("x.yaml")) == ("seed: 0\n", None)


# -- nothing left to train --------------------------------------------------------------


def test_nothing_left_to_train_names_max_steps_and_output_dir():
    line = nothing_left_to_train("runs/llm_tiny", 120)
    assert line.startswith("runs/llm_tiny is at max_steps=120: nothing left to train")
    assert "max_steps=240" in line and "output_dir=runs/llm_tiny_2" in line


# -- a data file rewritten with the same bytes ------------------------------------------


def test_a_data_file_rewritten_with_identical_bytes_is_the_same_input(tmp_path):
    from freetx.checkpoint import input_identity
    from freetx.checkpoint.identity import changed_inputs

    data = tmp_path / "corpus.txt"
    data.write_text("the quick brown fox " * 50)
    recorded = {"dataset": input_identity([data])}
    copy = tmp_path / "copy.txt"
    copy.write_bytes(data.read_bytes())
    os.replace(copy, data)  # a checkout: the same bytes, a new file and time
    stat = data.stat()
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    assert changed_inputs(recorded, {"dataset": input_identity([data])}) == []
    data.write_text("the quick brown cat " * 50)  # other bytes, the same size
    (line,) = changed_inputs(recorded, {"dataset": input_identity([data])})
    assert line.startswith("dataset:") and "changed since the run read them" in line


# -- the same, through runs (slow tier) -------------------------------------------------

TINY = ["max_steps=2", "eval.max_batches=1", "log_every_n_steps=1",
        "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"]  # fmt: skip


@pytest.mark.slow  # two short runs
def test_a_rerun_with_nothing_left_to_train_says_so_last_and_logs_nothing(tmp_path):
    out = tmp_path / "run"
    args = ["run", "full_finetune_fsdp2", "--config", "llm/tiny", f"output_dir={out}", *TINY]
    first = run_freetx(*args)
    assert first.returncode == 0, first.stderr
    # what the data is made of, once at start-up (llm/tiny: a token stream in windows)
    (summary,) = [line for line in first.stdout.splitlines() if line.startswith("data: ")]
    assert "documents (both splits, as one token stream) -> " in summary
    assert "sequences of 128 tokens, 0.0% padding (not packed)" in summary
    before = (out / "metrics.jsonl").read_text()
    again = run_freetx(*args)
    assert again.returncode == 0, again.stderr
    last = again.stdout.strip().splitlines()[-1]
    assert last.startswith(f"{out} is at max_steps=2: nothing left to train")
    assert f"output_dir={out}_2" in last
    assert (out / "metrics.jsonl").read_text() == before  # no second val/loss at step 2


@pytest.mark.slow  # a short run, then the copied recipe refused before any work
def test_a_copied_recipe_on_the_built_in_recipes_folder_is_refused(tmp_path):
    out = tmp_path / "run"
    args = ["--config", "llm/tiny", f"output_dir={out}", *TINY]
    assert run_freetx("run", "full_finetune_fsdp2", *args).returncode == 0
    assert json.loads((out / RECIPE_FILE).read_text())["recipe"] == "full_finetune_fsdp2"
    copy = tmp_path / "my_ft.py"
    assert run_freetx_here("cp", "full_finetune_fsdp2", str(copy)).returncode == 0
    refused = run_freetx("run", str(copy), *args, "max_steps=4")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    message = flat(refused.stderr)
    assert f"output_dir {out} holds a run of full_finetune_fsdp2" in message
    assert f"output_dir={out}_my_ft" in message
    assert json.loads((out / "checkpoints" / "step_000002" / "meta.json").read_text())[
        "recipe"
    ] == {"recipe": "full_finetune_fsdp2", "file": None}

"""Edges a user reaches, through the CLI (issue 25): data left without loss tokens by
seq_len, folders a run cannot write, a disk that fills during a save, numbers out of
range on the command line. Each ends in one paragraph, before any work where it can
be known before, and saved work is never touched."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.conftest import (
    ASSETS,
    REPO,
    flat,
    hashes,
    one_paragraph,
    run_freetx,
    run_freetx_here,
    run_refused_here,
)

TINY = ["max_steps=2", "batch_size=4", "log_every_n_steps=1", "eval.every_n_steps=0",
        "checkpoint.save_final=false", "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"]  # fmt: skip
THREADS = {"OMP_NUM_THREADS": "1"}


def pairs(path, prompt_lengths: list[int]):
    with open(path, "w") as f:
        for n in prompt_lengths:
            f.write(json.dumps({"prompt": "x" * n, "response": "yes"}) + "\n")
    return path


# -- data without loss tokens ---------------------------------------------------------
def instruct(tmp_path, source, *overrides):
    return run_freetx("run", "full_finetune_fsdp2", "--config", "llm/instruct_tiny",
                      f"dataset.source={source}", "dataset.seq_len=32", "dataset.val_fraction=0.25",
                      f"output_dir={tmp_path / 'run'}", *TINY, *overrides, env=THREADS)  # fmt: skip


def test_prompts_longer_than_seq_len_everywhere_are_refused_before_training(tmp_path):
    source = pairs(tmp_path / "long.jsonl", [100] * 40)
    result = instruct(tmp_path, source)
    message = one_paragraph(result)
    assert f"the train split of {source} has no loss tokens" in message
    assert "starts at token 101" in message and "Raise dataset.seq_len" in message
    assert "step 1/" not in result.stdout  # before the model was built


def test_a_validation_split_without_loss_tokens_is_refused(tmp_path):
    source = pairs(tmp_path / "short.jsonl", [10] * 40)
    validation = pairs(tmp_path / "val_long.jsonl", [100] * 8)
    message = one_paragraph(instruct(tmp_path, source, f"dataset.validation_source={validation}"))
    assert f"the validation split of {validation} has no loss tokens" in message


def test_samples_cut_or_emptied_are_counted_on_one_line_and_the_run_trains(tmp_path):
    source = pairs(tmp_path / "some_long.jsonl", [100 if i % 4 == 0 else 10 for i in range(40)])
    validation = pairs(tmp_path / "val.jsonl", [10] * 8)
    result = instruct(tmp_path, source, f"dataset.validation_source={validation}")
    assert result.returncode == 0, result.stderr
    assert (
        f"dataset {source} (train): 10 of 40 samples cut at seq_len=32, 10 left with no loss "
        "tokens (dropped)" in result.stdout
    )
    assert "train sequences 30" in result.stdout  # the 10 emptied ones are not trained on
    losses = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in losses if "loss" in r)


# -- bad rows and splits ----------------------------------------------------------------
def test_a_bad_row_stops_the_run_or_is_skipped_and_counted(tmp_path):
    """Error: one paragraph naming the row and both fixes, before training. Skip: the run
    trains and says once per split how many rows it skipped."""
    rows = [{"prompt": f"word{i}", "response": f"{i}drow"} for i in range(12)]
    rows[2], rows[5] = {"prompt": "no response"}, {"prompt": "a number", "response": 5}
    source = tmp_path / "bad.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [source, f"dataset.validation_source={source}"]
    failed = instruct(tmp_path, *args)
    message = one_paragraph(failed)
    assert f"{source}:3 has no 'response' column" in message and "on_bad_row=skip" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    skipped = instruct(tmp_path, *args, "dataset.on_bad_row=skip")
    assert skipped.returncode == 0, skipped.stderr
    for split in ("train", "validation"):  # validation_source is the same file: its own line
        line = f"dataset {source} ({split}): 2 of 12 rows skipped (dataset.on_bad_row=skip)"
        assert skipped.stdout.count(line) == 1, skipped.stdout
    assert "train sequences 10" in skipped.stdout


def test_a_split_left_empty_by_the_hash_says_how_to_fix_it(tmp_path):
    source = pairs(tmp_path / "one.jsonl", [10])
    message = one_paragraph(instruct(tmp_path, source))
    assert f"the validation split of {source} is empty" in message
    assert "dataset.val_fraction" in message and "dataset.validation_source" in message


# -- folders a run writes -------------------------------------------------------------
@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine\n")
    return path


@pytest.mark.parametrize(
    "config,key",
    [("llm/tiny", "output_dir"), ("ad/darkroom_tiny", "data_dir"),
     ("crosscoder/lm_layers_tiny", "activations.cache"),
     ("free_transformer/generate", "output_dir")],
    ids=["output_dir", "data_dir", "activations.cache", "generate"],
)  # fmt: skip
def test_validate_refuses_a_folder_under_a_file(a_file, config, key):
    result = run_freetx_here("validate", config, f"{key}={a_file}/sub")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{key}={a_file}/sub lies under {a_file}, which is a file" in flat(result.stdout)


def test_run_refuses_an_unwritable_output_dir_before_launch(tmp_path, a_file):
    before = hashes(tmp_path)
    result = run_refused_here("--nproc-per-node", "2", "full_finetune_fsdp2", "--config",
                              "llm/tiny", f"output_dir={a_file}")  # fmt: skip
    assert f"output_dir={a_file} is a file, and freetx writes a folder" in one_paragraph(result)
    assert hashes(tmp_path) == before


def test_an_activation_cache_in_a_folder_of_other_files_is_refused(tmp_path, a_file):
    before = hashes(tmp_path)
    result = run_freetx_here("validate", "crosscoder/lm_layers_tiny", "activations.mode=cache",
                             f"activations.cache={tmp_path}")  # fmt: skip
    assert result.returncode == 1 and "is a folder holding other files" in flat(result.stdout)
    assert hashes(tmp_path) == before


def read_only(folder, *args: str):
    """Run `freetx ARGS` with `folder` read-only: a read-only bind mount in a mount namespace
    of its own as root (chmod does not stop root), chmod 0o555 otherwise."""
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            return run_freetx(*args)
        finally:
            folder.chmod(0o755)
    if not shutil.which("unshare"):
        pytest.skip("root without unshare: no way to make a folder read-only here")
    mount = f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder}"
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "freetx", *args])
    result = subprocess.run(["unshare", "-m", "sh", "-c", f"{mount} && exec {command}"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    if "mount:" in result.stderr or "unshare:" in result.stderr:
        pytest.skip(f"no mount namespace here: {result.stderr.strip()}")
    return result


@pytest.mark.parametrize(
    "args,key",
    [(["validate", "llm/tiny"], "output_dir"),
     (["run", "ad_ddp", "--config", "ad/darkroom_tiny"], "data_dir"),
     (["validate", "crosscoder/lm_layers_tiny", "activations.mode=cache"], "activations.cache")],
    ids=["output_dir", "data_dir", "activations.cache"],
)  # fmt: skip
def test_a_folder_on_a_read_only_disk_is_refused_before_any_work(tmp_path, args, key):
    folder = tmp_path / "ro"
    result = read_only(folder, *args, f"{key}={folder}/sub")
    assert result.returncode == 1, result.stdout + result.stderr
    cause = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    assert f"{key}={folder}/sub cannot be written: {folder}: {cause}" in flat(
        result.stdout + result.stderr
    )
    assert "Traceback" not in result.stderr and "world size" not in result.stdout


@pytest.mark.parametrize(
    "args,elsewhere",
    [(["estimate", "llm/tiny", "--json", "{file}/x.json"], "another --json PATH"),
     (["cp", "llm/tiny", "{file}/t.yaml"], "another DEST"),
     (["launch", "slurm", "-o", "{file}/job.sbatch", "full_finetune_fsdp2", "--config", "llm/tiny"],
      "another -o FILE")],
    ids=["estimate", "cp", "launch"],
)  # fmt: skip
def test_a_user_file_under_a_file_is_refused_before_any_work(tmp_path, a_file, args, elsewhere):
    before = hashes(tmp_path)
    result = run_freetx_here(*[a.format(file=a_file) for a in args])
    message = one_paragraph(result)
    assert f"{a_file} is a file, and freetx writes a folder there" in message
    assert f"Give {elsewhere}." in message
    assert hashes(tmp_path) == before


def test_a_file_where_the_run_writes_a_file_is_one_paragraph_naming_it(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()  # a run folder whose JSONL log is a folder
    (tmp_path / "recipe.json").write_text('{"recipe": "full_finetune_fsdp2"}')
    result = run_freetx("run", "full_finetune_fsdp2", "--config", "llm/tiny",
                        f"output_dir={tmp_path}", *TINY, env=THREADS)  # fmt: skip
    assert f"{tmp_path / 'metrics.jsonl'}: Is a directory" in one_paragraph(result)


# -- a full disk during a save --------------------------------------------------------
def disk_full_at(step: str) -> dict:
    path = os.pathsep.join([str(ASSETS / "fault_injection"), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "FREETX_TEST_DISK_FULL": step, **THREADS}


def saving_every_2(tmp_path, async_save: bool = False) -> list[str]:
    return ["full_finetune_fsdp2", "--config", "llm/tiny", f"output_dir={tmp_path}",
            "checkpoint.every_n_steps=2", f"checkpoint.async_save={async_save}", *TINY[1:]]  # fmt: skip


def check_disk_full_message(result, tmp_path) -> None:
    message = one_paragraph(result)
    assert message.count("error:") == 1, message  # every rank's: one paragraph
    assert f"saving checkpoint step_000004 to {tmp_path / 'checkpoints'} failed" in message
    assert "the disk is full (No space left on device)" in message
    assert "Earlier checkpoints are untouched (latest: step_000002)" in message
    assert "run the same command to resume from step_000002" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["LATEST", "step_000002"]


def test_a_full_disk_during_a_save_is_named_without_thread_tracebacks(tmp_path):
    result = run_freetx("run", *saving_every_2(tmp_path), "max_steps=4",
                        env=disk_full_at("step_000004"))  # fmt: skip
    check_disk_full_message(result, tmp_path)


@pytest.mark.slow  # 30 s: two runs, one on 2 processes
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_on_2_processes_keeps_the_earlier_checkpoint_as_it_was(tmp_path, async_save):
    first = run_freetx("run", *saving_every_2(tmp_path, async_save), "max_steps=2", env=THREADS)
    assert first.returncode == 0, first.stderr
    saved = hashes(tmp_path / "checkpoints" / "step_000002")
    result = run_freetx("run", "--nproc-per-node", "2", *saving_every_2(tmp_path, async_save),
                        "max_steps=4", env=disk_full_at("step_000004"))  # fmt: skip
    check_disk_full_message(result, tmp_path)
    assert hashes(tmp_path / "checkpoints" / "step_000002") == saved


# -- numbers on the command line ------------------------------------------------------
@pytest.mark.parametrize(
    "args,message",
    [(["estimate", "llm/tiny", "--world-size", "0"], "--world-size: 0 is less than 1"),
     (["estimate", "llm/tiny", "--world-size", "-3"], "--world-size: -3 is less than 1"),
     (["estimate", "llm/tiny", "--mfu", "0"], "--mfu: 0 is not above 0"),
     (["estimate", "llm/tiny", "--mfu", "nan"], "--mfu: 'nan' is not a finite number"),
     (["estimate", "llm/tiny", "--replicas", "0"], "--replicas: 0 is less than 1"),
     (["validate", "llm/tiny", "--world-size", "0"], "--world-size: 0 is less than 1"),
     (["launch", "torchrun", "--nodes", "0", "--master-addr", "h", "full_finetune_fsdp2",
       "--config", "llm/tiny"], "--nodes: 0 is less than 1"),
     (["launch", "slurm", "--port", "70000", "full_finetune_fsdp2", "--config", "llm/tiny"],
      "--port/--master-port: 70000 is more than 65535"),
     (["launch", "slurm", "--signal-seconds", "0", "full_finetune_fsdp2", "--config", "llm/tiny"],
      "--signal-seconds: 0 is less than 1"),
     (["spectrum", "scan", "missing_model", "--top-percent", "150"],
      "--top-percent: 150 is more than 100"),
     (["crosscoder", "analyze", "missing_run", "--sources", "0", "-1"],
      "--sources: -1 is less than 0")],
)  # fmt: skip
def test_numbers_out_of_range_are_refused_by_the_parser(args, message):
    result = run_freetx_here(*args)
    assert result.returncode == 2 and message in flat(result.stderr), result.stderr


@pytest.mark.parametrize(
    "launch,message",
    [(["--nnodes", "2:1"], "2:1: nodes must be at least 1 (and MIN <= MAX)"),
     (["--max-restarts", "-1"], "--max-restarts/--max_restarts: -1 is less than 0")],
)  # fmt: skip
def test_torchrun_numbers_are_refused_before_launch(launch, message):
    result = run_refused_here(*launch, "full_finetune_fsdp2", "--config", "llm/tiny")
    assert result.returncode == 2 and message in flat(result.stderr), result.stderr
    assert "Traceback" not in result.stderr

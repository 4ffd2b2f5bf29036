"""Never lose saved work: each way a run or a conversion could destroy or silently replace
what a user saved, tried through the CLI. Afterwards the saved files are byte-identical
(hashed), the exit code is 1 and the message is one paragraph naming the fix.

`P` is a run folder of llm/tiny made on 2 processes, with step_000002 and step_000004
(keep_last 2); every test works on its own copy.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import flat, hashes, run_freetx, run_freetx_here, run_refused_here

QUIET = [
    "eval.max_batches=1", "log_every_n_steps=1", "checkpoint.every_n_steps=2",
    "checkpoint.keep_last=2", "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]",
]  # fmt: skip


def train(output_dir, *overrides, nproc=1, expect=0):
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    result = run_freetx(
        "run", *launch, "full_finetune_fsdp2", "--config", "llm/tiny",
        f"output_dir={output_dir}", *QUIET, *overrides,
    )  # fmt: skip
    assert result.returncode == expect, result.stdout + result.stderr
    if expect:
        assert "Traceback" not in result.stderr, result.stderr
    return result


def logged_steps(run: Path) -> list[int]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if "loss" in json.loads(line)]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("P") / "run"
    train(out, "max_steps=4", nproc=2)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "LATEST", "step_000002", "step_000004",
    ]  # fmt: skip
    return out


@pytest.fixture
def run(base_run, tmp_path) -> Path:
    copy = tmp_path / "P"
    shutil.copytree(base_run, copy)
    return copy


# -- an unusable LATEST ------------------------------------------------------------


@pytest.mark.parametrize(
    "damage,notice",
    [
        ("remove", "there is no LATEST file"),
        ("missing_folder", "LATEST names step_000010, which does not exist"),
        ("binary", "LATEST cannot be read as text"),
    ],
)
def test_unusable_latest_resumes_from_the_newest_complete_checkpoint(run, damage, notice):
    latest = run / "checkpoints" / "LATEST"
    if damage == "remove":
        latest.unlink()
    elif damage == "missing_folder":
        latest.write_text("step_000010\n")
    else:
        latest.write_bytes(b"\x00\xff\xfe\x81")
    before = hashes(run / "checkpoints" / "step_000004")
    result = train(run, "max_steps=6", nproc=2 if damage == "remove" else 1)
    out = flat(result.stdout)
    assert (
        notice in out and "the newest complete checkpoint is step_000004: resuming from it" in out
    )
    assert "(step 4," in result.stdout
    assert hashes(run / "checkpoints" / "step_000004") == before  # resumed, not replaced
    assert logged_steps(run) == [1, 2, 3, 4, 5, 6]  # the old lines, then 5 and 6
    assert latest.read_text().strip() == "step_000006"


def test_unusable_latest_with_other_settings_changes_nothing(run):
    """The reported case: `rm LATEST; B output_dir=P max_steps=2 seed=1` replaced step_000002."""
    (run / "checkpoints" / "LATEST").unlink()
    before = hashes(run)
    result = train(run, "max_steps=2", "seed=1", nproc=2, expect=1)
    message = flat(result.stderr)
    assert "there is no LATEST file; the newest complete checkpoint is step_000004" in message
    assert "- seed: 0 -> 1" in message
    assert "max_steps=2 is below the step of" in message and "(4)" in message
    assert message.count("freetx [ranks 0, 1]: error:") == 1  # one paragraph for both ranks
    assert hashes(run) == before  # checkpoints, config.yaml and metrics.jsonl untouched


def test_latest_naming_an_incomplete_folder_is_never_taken_or_replaced(run):
    (run / "checkpoints" / "step_000004" / ".metadata").unlink()
    before = hashes(run)
    result = train(run, "max_steps=6", nproc=2, expect=1)
    message = flat(result.stderr)
    assert "LATEST names step_000004, which is incomplete (no .metadata" in message
    assert "the newest complete checkpoint is step_000002" in message
    assert "later checkpoints that its saves would replace: - step_000004 (no .metadata" in message
    assert "checkpoint.overwrite=true" in message
    assert hashes(run) == before


def test_no_complete_checkpoint_is_refused_with_the_list(run):
    for step in ("step_000002", "step_000004"):
        (run / "checkpoints" / step / "meta.json").write_text("{not json")
    (run / "checkpoints" / "LATEST").unlink()
    before = hashes(run)
    message = flat(train(run, "max_steps=6", expect=1).stderr)
    assert "no checkpoint in" in message and "is complete" in message
    assert "- step_000002 (meta.json is not valid JSON)" in message
    assert "- step_000004 (meta.json is not valid JSON)" in message
    assert hashes(run) == before


def test_a_newer_complete_checkpoint_than_latest_is_not_overwritten(run):
    (run / "checkpoints" / "LATEST").write_text("step_000002\n")
    before = hashes(run)
    message = flat(train(run, "max_steps=6", expect=1).stderr)
    assert "this run starts at step 2 (step_000002)" in message
    assert f"Continue the newest with resume={run / 'checkpoints' / 'step_000004'}" in message
    assert hashes(run) == before


@pytest.mark.slow  # 11 s
def test_resume_never_over_checkpoints_is_refused_unless_overwrite(run):
    before = hashes(run / "checkpoints")
    message = flat(train(run, "max_steps=2", "resume=never", nproc=2, expect=1).stderr)
    assert "resume=never, but" in message and "- step_000002 (complete)" in message
    assert "checkpoint.overwrite=true" in message
    assert hashes(run / "checkpoints") == before

    old_step2 = hashes(run / "checkpoints" / "step_000002")
    result = train(run, "max_steps=2", "resume=never", "checkpoint.overwrite=true", "seed=1")
    assert "this run may replace step_000002, step_000004" in flat(result.stdout)
    assert hashes(run / "checkpoints" / "step_000002") != old_step2  # replaced, as asked
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step_000002"


def test_another_run_holding_the_folder_is_refused(run):
    before = hashes(run)
    with open(run / ".freetx.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 123 on somehost, started today\n")
        held.flush()
        message = flat(train(run, "max_steps=6", nproc=2, expect=1).stderr)
    assert "is in use by another run (pid 123 on somehost, started today)" in message
    assert hashes(run) == before


def test_unfinished_save_is_removed_and_said(run):
    tmp = run / "checkpoints" / ".tmp_step_000006"
    tmp.mkdir()
    (tmp / "__0_0.distcp").write_bytes(b"\0" * 100)
    result = train(run, "max_steps=4")
    assert "removed .tmp_step_000006, a save that did not finish" in result.stdout
    assert not tmp.exists()


# -- a resume with other settings ------------------------------------------------


def test_safe_changes_are_applied_and_listed(run):
    result = train(run, "max_steps=6", "optimizer.lr=0.03")
    out = flat(result.stdout)
    assert "settings changed since step_000004 was saved, applied from here on:" in out
    assert "max_steps: 4 -> 6" in out and "optimizer.lr: 0.003 -> 0.03" in out
    from freetx.training import LRScheduleConfig, lr_multiplier

    schedule = LRScheduleConfig(warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in records if "lr" in r}
    assert lr[5] == pytest.approx(0.03 * lr_multiplier(5, 6, schedule))  # the new lr, at once
    assert lr[4] == pytest.approx(0.003 * lr_multiplier(4, 4, schedule))


def test_max_steps_below_the_checkpoint_ends_with_a_message(run):
    before = hashes(run)
    message = flat(train(run, "max_steps=2", expect=1).stderr)
    assert "max_steps=2 is below the step of" in message and "Raise max_steps above 4" in message
    assert hashes(run) == before


def test_max_steps_at_the_checkpoint_trains_nothing_and_says_so(run):
    before = hashes(run / "checkpoints")
    result = train(run, "max_steps=4")
    last = result.stdout.strip().splitlines()[-1]  # the last line, naming what to pass
    assert last.startswith(f"{run} is at max_steps=4: nothing left to train")
    assert "step 4/2" not in result.stdout
    assert hashes(run / "checkpoints") == before


def test_fixed_settings_are_refused_and_config_yaml_is_kept(run):
    """A refused resume (here for the model's shape) leaves config.yaml as it was."""
    before = hashes(run)
    message = flat(train(run, "max_steps=6", "model.vocab_size=300", "seed=3", expect=1).stderr)
    assert "was saved with other settings that a resume may not change" in message
    assert "- model.vocab_size: 259 -> 300" in message and "- seed: 0 -> 3" in message
    assert "checkpoint.initial_weights=" in message
    assert hashes(run) == before
    assert "vocab_size: 259" in (run / "config.yaml").read_text()


# -- conversions -------------------------------------------------------------------


def convert(*args):
    return run_freetx_here("checkpoint", "convert", *map(str, args))


def refused(result, *fragments):
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in flat(result.stderr), result.stderr


def test_a_conversion_never_writes_over_its_source(base_run, tmp_path):
    ckpt = tmp_path / "step_000004"
    shutil.copytree(base_run / "checkpoints" / "step_000004", ckpt)
    assert convert(ckpt, tmp_path / "m.safetensors").returncode == 0
    assert convert(ckpt, tmp_path / "hf", "--to", "hf").returncode == 0
    before = hashes(tmp_path)
    same = tmp_path / "m.safetensors"
    refused(convert(same, same), "is the source")
    refused(convert(same, same, "--overwrite"), "is the source")  # not even when asked
    refused(convert(tmp_path / "hf", tmp_path / "hf", "--to", "hf"), "is the source")
    refused(convert(ckpt, ckpt, "--to", "dcp", "--overwrite"), "is the source")
    refused(convert(ckpt, ckpt / "inner", "--to", "dcp"), "lies inside the source")
    refused(convert(ckpt, tmp_path, "--to", "dcp", "--overwrite"), "holds the source")
    assert hashes(tmp_path) == before


def test_a_conversion_replaces_an_existing_destination_only_when_asked(base_run, tmp_path):
    ckpt = base_run / "checkpoints" / "step_000004"
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"someone's file")
    refused(convert(ckpt, out), "already exists", "--overwrite")
    assert out.read_bytes() == b"someone's file"
    assert convert(ckpt, out, "--overwrite").returncode == 0
    assert convert(out, tmp_path / "back.pt").returncode == 0  # a readable file now

    # a DCP folder replaced by --overwrite keeps no stale shard of what was there
    folder = tmp_path / "dcp"
    folder.mkdir()
    (folder / "__9_0.distcp").write_bytes(b"stale")
    refused(convert(ckpt, folder, "--to", "dcp"), "already exists")
    assert convert(ckpt, folder, "--to", "dcp", "--overwrite").returncode == 0
    assert not (folder / "__9_0.distcp").exists() and (folder / ".metadata").is_file()
    assert not list(tmp_path.glob(".*freetx-*"))  # no temporary left behind


def test_a_conversion_into_a_read_only_folder_is_one_paragraph(base_run, tmp_path):
    if os.geteuid() == 0:  # root writes through permission bits; sysfs refuses even root
        target = Path("/sys/freetx_test.safetensors")
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        target = locked / "m.safetensors"
    result = convert(base_run / "checkpoints" / "step_000004", target)
    refused(result, f"writing {target} failed", "Permission denied", "pick another path")
    assert not target.exists()


# -- damaged files and bad values: one paragraph, exit 1 ----------------------------


def test_damaged_metadata_and_hf_config_are_named(base_run, tmp_path):
    ckpt = tmp_path / "step_000004"
    shutil.copytree(base_run / "checkpoints" / "step_000004", ckpt)
    assert convert(ckpt, tmp_path / "hf", "--to", "hf").returncode == 0
    (ckpt / "meta.json").write_text('{"step": 4, oops')
    refused(run_freetx_here("checkpoint", "inspect", str(ckpt)), "meta.json is not valid JSON")
    (tmp_path / "hf" / "config.json").write_bytes(b"\x89PNG not json")
    hf_config = "HF model config"
    refused(
        run_freetx_here("checkpoint", "inspect", str(tmp_path / "hf")), hf_config, "not valid JSON"
    )
    refused(convert(tmp_path / "hf", tmp_path / "x.safetensors"), hf_config, "not valid JSON")
    result = train(tmp_path / "r", "max_steps=1", f"checkpoint.initial_weights={tmp_path / 'hf'}",
                   expect=1)  # fmt: skip
    assert "not valid JSON" in flat(result.stderr)


@pytest.mark.parametrize(
    "launch,overrides,fragment",
    [
        ([], ["gradient_accumulation_steps=0"], "'gradient_accumulation_steps' must be at least 1"),
        ([], ["batch_size=0"], "'batch_size' must be at least 1, got 0"),
        (["--nproc-per-node", "0"], [], "--nproc-per-node 0: a node needs at least 1 process"),
        (["--nproc-per-node", "abc"], [], "--nproc-per-node abc: Unsupported nproc_per_node"),
    ],
)
def test_impossible_values_are_one_paragraph(tmp_path, launch, overrides, fragment):
    result = run_refused_here(
        *launch, "full_finetune_fsdp2", "--config", "llm/tiny", f"output_dir={tmp_path}", *overrides
    )
    refused(result, fragment)


def test_a_binary_data_file_is_named(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_bytes(b"text then \xff\xfe\x00 bytes")
    result = train(tmp_path / "r", "max_steps=1", f"dataset.source={data}", expect=1)
    assert f"data file {data} is not UTF-8 text (byte 10" in flat(result.stderr)

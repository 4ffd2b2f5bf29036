"""What a user reads when something goes wrong, through the CLI (issue 25): an unreachable
rendezvous ends within its bound, the console holds freetx's lines only, a killed rank is
named first, a NaN stop with no checkpoint says so, and a LoRA (adapter-only) checkpoint
gets advice that works."""

from __future__ import annotations

import os
import re
import shutil
import socket

import pytest

from tests.conftest import ASSETS, flat, hashes, one_paragraph, run_freetx, run_freetx_here

QUICK = ["log_every_n_steps=1", "eval.every_n_steps=0",
         "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"]  # fmt: skip
THREADS = {"OMP_NUM_THREADS": "1"}
NOISE = ("FutureWarning", "_C_mxfp8", "_C_cutlass", "KernelPreference")


def fault(**variables: str) -> dict[str, str]:
    path = os.pathsep.join([str(ASSETS / "fault_injection"), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, **THREADS, **variables}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 2-process tiny run (checkpoint at step 2) and a QLoRA run on it (adapter-only
    checkpoints), with their stderr."""
    root = tmp_path_factory.mktemp("messages")
    base = run_freetx("run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config",
                      "llm/tiny", f"output_dir={root / 'base'}", "max_steps=2",
                      "checkpoint.every_n_steps=2", *QUICK, env=THREADS)  # fmt: skip
    assert base.returncode == 0, base.stderr
    qlora = run_freetx("run", "lora_finetune_fsdp2", "--config", "llm/qlora_tiny",
                       f"model_dir={root / 'base'}", f"output_dir={root / 'qlora'}",
                       "max_steps=1", "checkpoint.every_n_steps=1", *QUICK, env=THREADS)  # fmt: skip
    assert qlora.returncode == 0, qlora.stderr
    return {"root": root, "base": root / "base", "qlora": root / "qlora",
            "stderr": [base.stderr, qlora.stderr]}  # fmt: skip


# -- 1. the rendezvous ----------------------------------------------------------------


@pytest.mark.parametrize(
    "launch",
    [("--node-rank", "1", "--master-addr", "no-such-host.invalid", "--master-port", "29555"),
     ("--rdzv-backend", "c10d", "--rdzv-endpoint", "no-such-host.invalid:29555")],
    ids=["static", "c10d"],
)  # fmt: skip
def test_an_unresolvable_rendezvous_host_stops_at_once_naming_it(tmp_path, launch):
    result = run_freetx("run", "--nnodes", "2", *launch, "full_finetune_fsdp2", "--config",
                        "llm/tiny", f"output_dir={tmp_path / 'out'}", timeout=120)  # fmt: skip
    message = one_paragraph(result)
    assert "rendezvous host no-such-host.invalid (port 29555) does not resolve" in message
    assert "same address" in message and "firewall" in message
    assert not (tmp_path / "out").exists()


def test_a_rendezvous_where_nothing_listens_stops_after_the_timeout(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run_freetx("run", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2",
                        "--master-addr", "127.0.0.1", "--master-port", str(port),
                        "--rendezvous-timeout", "2", "full_finetune_fsdp2", "--config",
                        "llm/tiny", f"output_dir={tmp_path / 'out'}", timeout=120)  # fmt: skip
    message = one_paragraph(result)
    assert f"the rendezvous at 127.0.0.1:{port} did not answer within 2 s" in message
    assert "node 0 was started" in message and "--rendezvous-timeout" in message
    assert not (tmp_path / "out").exists()


# -- 2. the console holds freetx's lines ------------------------------------------------


def test_runs_print_no_known_noise(runs):
    for stderr in runs["stderr"]:
        assert not [line for line in stderr.splitlines() if any(n in line for n in NOISE)], stderr


# -- 3a. a rank killed mid-save ---------------------------------------------------------


@pytest.mark.slow  # 20 s: a 2-process resume that dies in its save
def test_a_rank_killed_during_a_save_is_named_first_and_saved_work_is_kept(tmp_path, runs):
    run_dir = tmp_path / "run"
    shutil.copytree(runs["base"], run_dir)
    saved = run_dir / "checkpoints" / "step_000002"
    before = hashes(saved)
    result = run_freetx("run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config",
                        "llm/tiny", f"output_dir={run_dir}", "max_steps=4",
                        "checkpoint.every_n_steps=2", *QUICK,
                        env=fault(FREETX_TEST_KILL_SAVE="step_000004",
                                  FREETX_TEST_KILL_SAVE_SIGNAL="1"))  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("freetx run: rank 1 was killed by SIGKILL (exit code -9")
    message = flat(result.stderr)
    assert "saving checkpoint step_000004" in message and "another rank's process ended" in message
    for internal in ("GLHF", "gloo", "pair.cc", "disk space"):
        assert internal not in message
    assert (run_dir / "checkpoints" / "LATEST").read_text().strip() == "step_000002"
    assert hashes(saved) == before


# -- 3b. a NaN stop before any checkpoint -------------------------------------------------


def test_a_nan_stop_before_any_checkpoint_says_none_exists(tmp_path):
    result = run_freetx("run", "full_finetune_fsdp2", "--config", "llm/tiny",
                        f"output_dir={tmp_path}", "max_steps=4", "on_nonfinite=stop",
                        "checkpoint.every_n_steps=100", *QUICK,
                        env=fault(FREETX_TEST_FAULT="nan:2:0"))  # fmt: skip
    message = one_paragraph(result)
    assert "not finite at step 2" in message
    assert "No checkpoint of this run exists yet" in message
    assert "resume from that checkpoint" not in message and "step 0" not in message
    assert "optimizer.lr" in message and "max_grad_norm" in message and "param_dtype" in message
    assert not list((tmp_path / "checkpoints").glob("step_*"))


def test_a_nan_under_in_backward_stops_saying_the_update_could_not_be_skipped(tmp_path):
    result = run_freetx("run", "full_finetune_fsdp2", "--config", "llm/tiny",
                        f"output_dir={tmp_path}", "max_steps=4", "checkpoint.every_n_steps=1",
                        "optimizer.in_backward=true", "max_grad_norm=null", *QUICK,
                        env=fault(FREETX_TEST_FAULT="nan:3:0"))  # fmt: skip
    message = one_paragraph(result)  # on_nonfinite=skip cannot skip it: the run stops
    assert "not finite at step 3" in message and "could not be skipped" in message
    assert "the last one is step 2" in message
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert saved[-1] == "step_000002"


# -- 3c, 3d. adapter-only checkpoints -----------------------------------------------------


def refused_rank_change(runs) -> str:
    """The message of a resume of the QLoRA run with another LoRA rank (refused)."""
    qlora = runs["qlora"]
    before = hashes(qlora / "checkpoints")
    refused = run_freetx("run", "lora_finetune_fsdp2", "--config", "llm/qlora_tiny",
                         f"model_dir={runs['base']}", f"output_dir={qlora}", "max_steps=2",
                         "peft.rank=4", *QUICK, env=THREADS)  # fmt: skip
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert hashes(qlora / "checkpoints") == before
    return flat(refused.stderr)


def test_a_lora_rank_change_suggests_a_merge_not_the_adapters_as_weights(runs):
    message = refused_rank_change(runs)
    assert "peft.rank: 8 -> 4" in message
    assert f"initial_weights={runs['qlora']}" not in message  # adapters are not a whole model
    assert f"freetx checkpoint merge {runs['qlora']}/checkpoints/step_000001 --base" in message
    assert "output_dir=NEW checkpoint.initial_weights=MERGED" in message


@pytest.mark.slow  # 25 s: a refusal, a merge and a new run
def test_the_suggested_merge_starts_a_new_run_with_the_new_rank(tmp_path, runs):
    message = refused_rank_change(runs)
    merge = re.search(r"freetx checkpoint merge (\S+) --base (\S+) MERGED", message)
    merged = tmp_path / "merged"
    done = run_freetx_here("checkpoint", "merge", merge[1], "--base", merge[2], str(merged))
    assert done.returncode == 0, done.stderr
    new = run_freetx("run", "lora_finetune_fsdp2", "--config", "llm/qlora_tiny",
                     f"model_dir={runs['base']}", f"output_dir={tmp_path / 'new'}",
                     f"checkpoint.initial_weights={merged}", "max_steps=1", "peft.rank=4",
                     *QUICK, env=THREADS)  # fmt: skip
    assert new.returncode == 0, new.stderr
    assert f"initial weights from {merged}" in new.stdout


def test_adapter_only_checkpoints_are_refused_where_a_whole_model_is_needed(tmp_path, runs):
    checkpoint = runs["qlora"] / "checkpoints" / "step_000001"
    advice = [f"{checkpoint} is adapter-only",
              f"freetx checkpoint merge {checkpoint} --base {runs['base']} MERGED",
              f"freetx checkpoint convert {checkpoint} ADAPTER_DIR --to peft"]  # fmt: skip
    convert = run_freetx_here("checkpoint", "convert", str(runs["qlora"]), str(tmp_path / "hf"),
                              "--to", "hf")  # fmt: skip
    message = one_paragraph(convert)
    assert all(line in message for line in advice), message
    assert not (tmp_path / "hf").exists()
    generate = run_freetx("run", "generate", "--config", "free_transformer/generate",
                          f"checkpoint={runs['qlora']}", f"output_dir={tmp_path / 'gen'}")  # fmt: skip
    message = one_paragraph(generate)
    assert all(line in message for line in advice), message

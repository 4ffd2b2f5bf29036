"""Surviving faults on 2 processes, through the CLI: two "nodes" from `freetx launch
torchrun`, a rank killed (torchrun restarts the group), SIGTERM (save at the step
boundary, exit 75, continue exactly), a NaN (skipped or stopped), a hung rank (the
collective timeout names it), Ctrl-C, and each step logged once after a resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ASSETS, REPO, flat, run_freetx, run_freetx_here

SMALL = ["max_steps=12", "log_every_n_steps=1", "eval.every_n_steps=0",
         "lr_schedule.decay=constant", "lr_schedule.warmup_steps=0",
         "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"]  # fmt: skip
THREADS = {"OMP_NUM_THREADS": "1"}  # the same arithmetic whatever the process layout


def fault(kind: str, step: int, rank: int) -> dict:
    path = os.pathsep.join([str(ASSETS / "fault_injection"), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "FREETX_TEST_FAULT": f"{kind}:{step}:{rank}", **THREADS}


def losses(output_dir) -> dict[int, float]:
    records = [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def train(output_dir, *overrides, launch=("--nproc-per-node", "2"), env=None, expect=0):
    result = run_freetx("run", *launch, "full_finetune_fsdp2", "--config", "llm/tiny",
                        f"output_dir={output_dir}", *SMALL, *overrides, env=env or THREADS)  # fmt: skip
    assert result.returncode == expect, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The undisturbed run: 12 steps on 1 node x 2 processes."""
    output_dir = tmp_path_factory.mktemp("straight")
    train(output_dir)
    return losses(output_dir)


@pytest.mark.slow  # make test stays under 12 min
def test_two_nodes_from_launch_torchrun_equal_one_node(tmp_path, straight):
    printed = run_freetx("launch", "torchrun", "--nodes", "2", "--master-addr", "127.0.0.1",
                         "--port", "29731", "full_finetune_fsdp2", "--config", "llm/tiny",
                         f"output_dir={tmp_path}", *SMALL)  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    commands = [line for line in printed.stdout.splitlines() if not line.startswith("#")]
    assert len(commands) == 2 and "--node-rank 1" in commands[1]
    env = {**os.environ, **THREADS, "PYTHONUNBUFFERED": "1"}
    nodes = [subprocess.Popen(c, shell=True, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for c in commands]  # fmt: skip
    outputs = [n.communicate(timeout=600)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs
    assert losses(tmp_path) == straight


@pytest.mark.slow  # ~15-20 s of 2-process runs: make test's 12 minutes
def test_a_killed_rank_is_restarted_and_continues_exactly(tmp_path, straight):
    result = train(tmp_path, "checkpoint.every_n_steps=4", env=fault("kill", 7, 1),
                   launch=("--nproc-per-node", "2", "--max-restarts", "1"))  # fmt: skip
    assert "resumed from" in result.stdout and "(step 4," in result.stdout
    resumed = losses(tmp_path)
    assert sorted(resumed) == list(range(1, 13))
    for step in range(5, 13):
        assert resumed[step] == straight[step], step


@pytest.mark.slow  # ~15-20 s of 2-process runs: make test's 12 minutes
def test_sigterm_saves_at_the_step_boundary_and_the_rerun_continues_exactly(tmp_path, straight):
    result = train(tmp_path, env=fault("sigterm", 5, 0), expect=75)
    assert "stopped by SIGTERM at step 5" in flat(result.stderr)
    assert "Traceback" not in result.stderr
    assert (tmp_path / "checkpoints" / "LATEST").read_text().strip() == "step_000005"
    assert not (tmp_path / "PREEMPTED").exists()  # read and removed by freetx run
    train(tmp_path)
    resumed = losses(tmp_path)
    assert sorted(resumed) == list(range(1, 13))
    assert all(resumed[s] == straight[s] for s in range(1, 13))


@pytest.mark.slow  # ~15-20 s of 2-process runs: make test's 12 minutes
@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_a_nan_is_skipped_or_stops_and_never_reaches_a_checkpoint(tmp_path, policy):
    expect = 0 if policy == "skip" else 1
    result = train(tmp_path, "checkpoint.every_n_steps=4", "checkpoint.keep_last=10", f"on_nonfinite={policy}",
                   env=fault("nan", 6, 1), expect=expect)  # fmt: skip
    assert "step 6: the gradient norm is nan; the update was skipped" in result.stdout
    checkpoint = tmp_path / "checkpoints" / "step_000004"
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    if policy == "stop":
        assert "not finite at step 6" in flat(result.stderr) and "Traceback" not in result.stderr
        assert (tmp_path / "checkpoints" / "LATEST").read_text().strip() == "step_000004"
    else:
        final = run_freetx_here(
            "checkpoint", "convert", str(tmp_path), str(tmp_path / "m.safetensors")
        )
        assert final.returncode == 0
        from safetensors.torch import load_file

        weights = load_file(str(tmp_path / "m.safetensors"))
        assert all(t.isfinite().all() for t in weights.values())
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == before


@pytest.mark.slow  # 45 s: waits for the timeout
def test_a_hung_rank_ends_the_job_within_the_timeout_and_is_named(tmp_path):
    start = time.monotonic()
    result = train(tmp_path, "distributed.collective_timeout_s=8", env=fault("hang", 4, 1),
                   expect=1)  # fmt: skip
    elapsed = time.monotonic() - start
    message = flat(result.stderr)
    assert "did not complete within distributed.collective_timeout_s" in message
    assert "waited at step 4" in message
    assert "rank 1 never reached that collective" in message
    assert elapsed < 60, elapsed  # start-up + 8 s + the shutdown, not the 600 s sleep


@pytest.mark.slow  # 9 s
def test_ctrl_c_saves_at_the_step_boundary_and_ends_in_one_line(tmp_path):
    command = [sys.executable, "-m", "freetx", "run", "--nproc-per-node", "2",
               "full_finetune_fsdp2", "--config", "llm/tiny", f"output_dir={tmp_path}",
               *SMALL, "max_steps=400"]  # fmt: skip
    env = {**os.environ, **THREADS, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (
        metrics.exists() and len(metrics.read_text().splitlines()) >= 3
    ):
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    out, err = process.communicate(timeout=300)
    assert process.returncode == 130, out + err
    assert "Traceback" not in err and "SignalException" not in err
    assert "stopped by SIGINT" in flat(err)
    latest = (tmp_path / "checkpoints" / "LATEST").read_text().strip()
    assert int(latest.removeprefix("step_")) >= 3

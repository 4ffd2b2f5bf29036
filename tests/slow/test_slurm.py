"""`freetx launch slurm --submit` under a real SLURM (Debian's slurm-wlm on localhost,
set up by tests/slurm/start_slurm.sh): a 2-process job of llm/tiny runs to the end, and
a job signalled with USR1 (what --signal=USR1@90 sends before the time limit) saves at
the step boundary, requeues itself and continues exactly. Skipped, saying why, where
SLURM cannot be installed or started."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, run_freetx

pytestmark = pytest.mark.slow
SMALL = ["log_every_n_steps=1", "eval.every_n_steps=0", "checkpoint.every_n_steps=0",
         "lr_schedule.decay=constant", "lr_schedule.warmup_steps=0",
         "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"]  # fmt: skip


@pytest.fixture(scope="module")
def slurm():
    script = REPO / "tests" / "slurm" / "start_slurm.sh"
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.skip(
            f"SLURM is not available here ({(result.stderr or result.stdout).strip()[-300:]})"
        )


def job_state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    for part in out.split():
        if part.startswith("JobState="):
            return part.split("=", 1)[1]
    return "GONE"


def wait_for(job: str, states: set[str], timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    hurried = False
    while time.monotonic() < deadline:
        state = job_state(job)
        if state in states:
            return state
        if state == "PENDING" and not hurried:
            # a requeued job waits cred_expire (120 s) for its begin time; 2 s, please,
            # once: slurmd refuses a credential made in the second the old one was
            # revoked ("Job credential revoked"), so "now" failed the job at times
            subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now+2"],
                           capture_output=True)  # fmt: skip
            hurried = True
        time.sleep(2)
    raise AssertionError(f"job {job} still {job_state(job)} after {timeout} s")


def submit(tmp_path, port: int, *overrides) -> str:
    result = run_freetx("launch", "slurm", "--nproc-per-node", "2", "--port", str(port),
                        "--submit", "-o", str(tmp_path / "job.sbatch"), "--log",
                        str(tmp_path / "slurm-%j.out"), "--env", "OMP_NUM_THREADS=1",
                        "full_finetune_fsdp2", "--config", "llm/tiny",
                        f"output_dir={tmp_path / 'run'}", *SMALL, *overrides)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Submitted batch job")
    return result.stdout.split()[-1]


def losses(output_dir) -> dict[int, float]:
    records = [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert len(steps) == len(set(steps)), steps
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_a_submitted_job_runs_to_the_end(slurm, tmp_path):
    job = submit(tmp_path, 29741, "max_steps=10")
    assert wait_for(job, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED", (
        tmp_path / f"slurm-{job}.out"
    ).read_text()
    assert sorted(losses(tmp_path / "run")) == list(range(1, 11))
    assert (tmp_path / "run" / "checkpoints" / "LATEST").read_text().strip() == "step_000010"
    script = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1" in script and "#SBATCH --requeue" in script


def test_usr1_saves_requeues_and_the_job_continues_exactly(slurm, tmp_path):
    straight = tmp_path / "straight"
    result = run_freetx("run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config",
                        "llm/tiny", f"output_dir={straight}", *SMALL, "max_steps=60",
                        env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    assert result.returncode == 0, result.stderr
    job = submit(tmp_path, 29742, "max_steps=60")
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 8):
        assert time.monotonic() < deadline, "the job did not start training"
        time.sleep(1)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    wait_for(job, {"PENDING", "REQUEUED", "REQUEUE_HOLD"}, timeout=300)
    assert wait_for(job, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED"
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert "stopped by SIGUSR1" in log and "requeueing job" in log and "restart 1" in log
    resumed, expected = losses(tmp_path / "run"), losses(straight)
    assert sorted(resumed) == list(range(1, 61))
    assert resumed == expected


def test_srun_one_task_per_process_without_torchrun(slurm, tmp_path):
    """`srun freetx run RECIPE` with 2 tasks: ranks from SLURM's variables."""
    script = tmp_path / "tasks.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output=" + str(tmp_path / "out-%j.txt") + "\n"
        f"cd {REPO}\nexport OMP_NUM_THREADS=1\n"
        f"srun {sys.executable} -m freetx run full_finetune_fsdp2 --config llm/tiny "
        f"output_dir={tmp_path / 'run'} max_steps=4 " + " ".join(f"'{o}'" for o in SMALL) + "\n"
    )
    job = subprocess.run(["sbatch", str(script)], capture_output=True, text=True, check=True)
    job_id = job.stdout.split()[-1]
    assert wait_for(job_id, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED", (
        tmp_path / f"out-{job_id}.txt"
    ).read_text()
    assert "world size 2" in (tmp_path / f"out-{job_id}.txt").read_text()
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4]


def test_a_partition_slurm_rejects_is_its_message(slurm, tmp_path):
    result = run_freetx("launch", "slurm", "--partition", "nosuchpartition", "--submit",
                        "-o", str(tmp_path / "job.sbatch"), "full_finetune_fsdp2", "--config",
                        "llm/tiny")  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr
    message = " ".join(result.stderr.split())
    assert "sbatch refused" in message and "invalid partition" in message.lower(), message

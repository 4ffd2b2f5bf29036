"""`freetx launch`: the SLURM script and the per-node torchrun commands, and bad input
refused before anything is written."""

from __future__ import annotations

import pytest

from tests.conftest import flat, run_freetx, run_freetx_here


def test_the_slurm_script_has_one_launcher_per_node_and_requeues(tmp_path):
    out = tmp_path / "job.sbatch"
    result = run_freetx_here(
        "launch", "slurm", "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu",
        "--time", "2-00:00:00", "--account", "proj", "--env", "NCCL_DEBUG=INFO",
        "--setup", "module load cuda", "--max-restarts", "2", "-o", str(out),
        "full_finetune_fsdp2", "--config", "llm/tiny", "max_steps=10", "batch_size=64",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    script = out.read_text()
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --signal=USR1@90", "#SBATCH --requeue", "#SBATCH --partition=gpu",
                 "#SBATCH --time=2-00:00:00", "#SBATCH --account=proj", "module load cuda",
                 "export NCCL_DEBUG=INFO", 'scontrol requeue "$SLURM_JOB_ID"'):  # fmt: skip
        assert line in script, line
    srun = next(line for line in script.splitlines() if line.startswith("srun"))
    assert '--nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node 8' in srun
    assert '--rdzv-endpoint "$head_node:$port"' in srun and "--max-restarts 2" in srun
    assert srun.endswith("full_finetune_fsdp2 --config llm/tiny max_steps=10 batch_size=64")


def test_torchrun_commands_one_per_node():
    result = run_freetx_here("launch", "torchrun", "--nodes", "3", "--nproc-per-node", "4",
                             "--master-addr", "10.0.0.1", "ad_ddp", "--config", "ad/darkroom_tiny",
                             "batch_size=96")  # fmt: skip
    commands = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    assert len(commands) == 3
    assert all("--nnodes 3" in c and "--master-addr 10.0.0.1" in c for c in commands)
    assert [f"--node-rank {r}" in c for r, c in enumerate(commands)] == [True] * 3


HSDP = ["distributed.strategy=hsdp", "distributed.replicate_degree=4"]


@pytest.mark.parametrize(
    "args,overrides,message",
    [(["--gpus-per-node", "0"], [], "--gpus-per-node 0"),
     (["--time", "2h"], [], "SLURM reads minutes"),
     (["--nodes", "3", "--gpus-per-node", "2"], HSDP, "replicate degree of 4 does not divide the 6 data-parallel ranks of the 3 node(s) x 2"),
     (["--env", "NOVALUE"], [], "NAME=VALUE")],
)  # fmt: skip
def test_bad_launch_input_is_one_paragraph_and_writes_nothing(tmp_path, args, overrides, message):
    out = tmp_path / "job.sbatch"
    result = run_freetx_here("launch", "slurm", *args, "-o", str(out), "full_finetune_fsdp2",
                             "--config", "llm/tiny", *overrides)  # fmt: skip
    assert result.returncode in (1, 2) and message in flat(result.stderr), result.stderr
    assert not out.exists()


def test_a_config_that_fails_validation_writes_no_script(tmp_path):
    out = tmp_path / "job.sbatch"
    result = run_freetx_here("launch", "slurm", "-o", str(out), "full_finetune_fsdp2",
                             "--config", "llm/tiny", "max_stpes=10")  # fmt: skip
    assert result.returncode == 1 and "did you mean 'max_steps'" in flat(result.stderr)
    assert not out.exists()


def test_submit_without_sbatch_says_so_and_writes_nothing(tmp_path):
    out = tmp_path / "job.sbatch"
    result = run_freetx("launch", "slurm", "--submit", "-o", str(out), "full_finetune_fsdp2",
                        "--config", "llm/tiny", env={"PATH": str(tmp_path)})  # fmt: skip
    assert result.returncode == 1 and "sbatch, which is not on" in flat(result.stderr)
    assert not out.exists() and "Traceback" not in result.stderr


def test_torchrun_commands_check_the_host_and_take_torchruns_port_flag():
    bad = run_freetx_here("launch", "torchrun", "--master-addr", "not a host!!",
                          "full_finetune_fsdp2", "--config", "llm/tiny")  # fmt: skip
    assert bad.returncode == 2 and "not a host name or an IP address" in bad.stderr
    good = run_freetx_here("launch", "torchrun", "--nodes", "2", "--master-addr", "node-01",
                           "--master-port", "29600", "full_finetune_fsdp2", "--config",
                           "llm/tiny")  # fmt: skip
    assert good.returncode == 0 and good.stdout.count("--master-port 29600") == 2

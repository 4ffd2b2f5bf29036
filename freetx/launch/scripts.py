"""What `freetx launch` writes: a SLURM batch script, or one torchrun command per node.

SLURM: one task per node (never one per GPU with a launcher inside, which starts
N x N processes), each running `freetx run` (torchrun's launcher) with c10d
rendezvous on the first node of the allocation; `--signal=USR1@S` asks every
process to save at the next step boundary S seconds before the time limit, and a
run that stopped that way exits 75, which the script answers with `scontrol
requeue`: the requeued job resumes from that checkpoint. `--requeue` lets SLURM
requeue it after a node failure or pre-emption too.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from freetx.errors import PREEMPTED_EXIT_CODE, UsageError


@dataclass
class LaunchSpec:
    """Where and how many: nodes, processes (GPUs) per node, and SLURM's settings."""

    recipe: str
    recipe_args: list[str]  # --config CFG and overrides, as given
    nodes: int = 1
    gpus_per_node: int = 0  # 0: CPU nodes, `nproc_per_node` processes each
    nproc_per_node: int = 1
    port: int = 29500
    max_restarts: int = 0
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    mem_per_gpu: str | None = None
    mem: str | None = None
    job_name: str = "freetx"
    env: list[str] = field(default_factory=list)  # K=V
    setup: str | None = None  # shell lines before the run (module load ...; source ...)
    signal_seconds: int = 90
    python: str = "python"  # the interpreter that has freetx
    log: str = "slurm-%j.out"
    workdir: str | None = None

    @property
    def processes_per_node(self) -> int:
        return self.gpus_per_node or self.nproc_per_node

    def check(self) -> None:
        if self.nodes < 1:
            raise UsageError(f"--nodes {self.nodes}: a job needs at least 1 node.")
        if self.gpus_per_node < 0 or self.nproc_per_node < 1:
            raise UsageError(
                "--gpus-per-node must be at least 1 on GPU nodes (or leave it out and give "
                "--nproc-per-node N for N processes on each CPU node)."
            )
        for item in self.env:
            if "=" not in item or item.startswith("="):
                raise UsageError(f"--env {item}: write it as NAME=VALUE.")

    def freetx_run(self, *launch: str) -> list[str]:
        return [self.python, "-m", "freetx", "run", *launch, self.recipe, *self.recipe_args]


def slurm_script(spec: LaunchSpec, command_line: str) -> str:
    """A batch script for `sbatch`: see the module docstring."""
    spec.check()
    lines = ["#!/bin/bash", f"# written by: {command_line}"]
    sbatch = [
        f"--job-name={spec.job_name}",
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",  # one launcher per node; it starts the processes
        f"--output={spec.log}",
        "--open-mode=append",  # a requeued job adds to the same log
        f"--signal=USR1@{spec.signal_seconds}",
        "--requeue",
    ]
    if spec.gpus_per_node:
        sbatch.append(f"--gpus-per-node={spec.gpus_per_node}")
    for flag, value in (("partition", spec.partition), ("time", spec.time),
                        ("account", spec.account), ("cpus-per-task", spec.cpus_per_task),
                        ("mem-per-gpu", spec.mem_per_gpu), ("mem", spec.mem)):  # fmt: skip
        if value is not None:
            sbatch.append(f"--{flag}={value}")
    lines += [f"#SBATCH {s}" for s in sbatch]
    lines += ["", "set -uo pipefail"]
    if spec.workdir:
        lines.append(f"cd {shlex.quote(spec.workdir)}")
    if spec.setup:
        lines += ["", "# set-up", spec.setup]
    if spec.env:
        lines += ["", *[f"export {shlex.quote(item.split('=', 1)[0])}={shlex.quote(item.split('=', 1)[1])}"
                        for item in spec.env]]  # fmt: skip
    run = spec.freetx_run(
        "--nnodes", "$SLURM_JOB_NUM_NODES", "--nproc-per-node", str(spec.processes_per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"$head_node:{spec.port}",
        "--rdzv-id", "$SLURM_JOB_ID", "--max-restarts", str(spec.max_restarts),
    )  # fmt: skip
    # shell variables stay expandable ("$head_node:29500"); everything else is quoted
    quoted = " ".join(f'"{a}"' if a.startswith("$") else shlex.quote(a) for a in run)
    lines += [
        "",
        "# the first node of the allocation hosts the rendezvous",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'echo "freetx: job $SLURM_JOB_ID on $SLURM_JOB_NUM_NODES node(s), head $head_node, '
        'restart ${SLURM_RESTART_COUNT:-0}"',
        "",
        "# one task per node: each runs torchrun (freetx run), which starts the processes",
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 {quoted}",
        "status=$?",
        f"if [ $status -eq {PREEMPTED_EXIT_CODE} ]; then",
        "  # stopped on SIGUSR1/SIGTERM after saving at a step boundary: run again from there",
        '  echo "freetx: pre-empted; requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        "exit $status",
        "",
    ]
    return "\n".join(lines)


def torchrun_commands(spec: LaunchSpec, master_addr: str, node_rank: int | None) -> str:
    """The command each node runs (static rendezvous on `master_addr`), one per line."""
    spec.check()
    ranks = range(spec.nodes) if node_rank is None else [node_rank]
    if node_rank is not None and not 0 <= node_rank < spec.nodes:
        raise UsageError(f"--node-rank {node_rank} is not in 0..{spec.nodes - 1}.")
    out = []
    for rank in ranks:
        command = spec.freetx_run(
            "--nnodes", str(spec.nodes), "--node-rank", str(rank),
            "--nproc-per-node", str(spec.processes_per_node), "--master-addr", master_addr,
            "--master-port", str(spec.port), "--max-restarts", str(spec.max_restarts),
        )  # fmt: skip
        out.append(f"# node {rank} of {spec.nodes}")
        out.append(" ".join(shlex.quote(a) for a in command))
    return "\n".join(out) + "\n"

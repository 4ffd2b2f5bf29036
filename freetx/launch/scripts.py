"""What `freetx launch` writes: a SLURM batch script, or one torchrun command per node.

SLURM: one task per node (never one per GPU with a launcher inside, which starts
N x N processes), each running `freetx run` (torchrun's launcher) with c10d
rendezvous on the first node of the allocation; `--signal=USR1@S` asks every
process to save at the next step boundary S seconds before the time limit, and a
run that stopped that way exits 75, which the script answers with `scontrol
requeue`: the requeued job resumes from that checkpoint. `--requeue` lets SLURM
requeue it after a node failure or pre-emption too.

The script decides at run time what only the node knows: the user's set-up lines run
first (before `set -u`: many `module load` and conda scripts read unset variables),
then the Python is found (FREETX_PYTHON, else the `python` on PATH after the set-up,
so a venv or conda environment activated there is used, else the interpreter that
wrote the script), and the rendezvous port is one the head node finds free (unless
--port fixed it).

Every value that goes into a script is quoted (shlex) or refused (`refuse_unsafe`): a
script holds nothing the shell or sbatch would read as anything but the value given,
and `check_shell_syntax` runs `bash -n` over it before it is written or printed.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field

from freetx.errors import PREEMPTED_EXIT_CODE, UsageError

# what an #SBATCH value may hold: sbatch reads these lines itself, not the shell
SBATCH_VALUE = re.compile(r"^[A-Za-z0-9_.,:@%+=/-]+$")
JOB_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MEMORY = re.compile(r"^\d+[KMGT]?$", re.IGNORECASE)
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# the head node picks a port no process holds at that moment
FREE_PORT = 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'


@dataclass
class LaunchSpec:
    """Where and how many: nodes, processes (GPUs) per node, and SLURM's settings."""

    recipe: str
    recipe_args: list[str]  # --config CFG and overrides, as given
    nodes: int = 1
    gpus_per_node: int = 0  # 0: CPU nodes, `nproc_per_node` processes each
    nproc_per_node: int = 1
    port: int | None = None  # None: SLURM's script finds a free one on the head node
    max_restarts: int = 0
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None  # None: one per process, more for loader workers
    mem_per_gpu: str | None = None
    mem: str | None = None  # None: "0", all of each node's memory (unless mem_per_gpu)
    job_name: str = "freetx"
    env: list[str] = field(default_factory=list)  # K=V
    setup: str | None = None  # shell lines before the run (module load ...; source ...)
    signal_seconds: int = 90
    python: str | None = None  # None: found at run time (see the module docstring)
    fallback_python: str | None = None  # the interpreter that wrote the script
    log: str = "slurm-%j.out"
    workdir: str | None = None
    loader_workers: int = 0  # each process's data-loader workers (num_workers)
    trust: list[str] = field(default_factory=list)  # `freetx run --trust` (docs/trust.md)

    @property
    def processes_per_node(self) -> int:
        return self.gpus_per_node or self.nproc_per_node

    @property
    def cpus(self) -> int:
        """CPUs each node's task asks for: one per process and one per loader worker."""
        return self.cpus_per_task or self.processes_per_node * (1 + self.loader_workers)

    def check(self) -> None:
        if self.nodes < 1:
            raise UsageError(f"--nodes {self.nodes}: a job needs at least 1 node.")
        if self.gpus_per_node < 0 or self.nproc_per_node < 1:
            raise UsageError(
                "--gpus-per-node must be at least 1 on GPU nodes (or leave it out and give "
                "--nproc-per-node N for N processes on each CPU node)."
            )
        for item in self.env:
            name = item.split("=", 1)[0]
            if "=" not in item or not ENV_NAME.match(name):
                raise UsageError(
                    f"--env {item!r}: write it as NAME=VALUE, NAME a shell variable name "
                    "(letters, digits and _, not starting with a digit), e.g. --env "
                    "NCCL_DEBUG=INFO."
                )
        refuse_unsafe(self)

    def freetx_run(self, python: str, *launch: str) -> list[str]:
        trust = [f"--trust={name}" for name in self.trust]
        return [python, "-m", "freetx", "run", *launch, *trust, self.recipe, *self.recipe_args]


def refuse_unsafe(spec: LaunchSpec) -> None:
    """Refuse a value a script cannot hold as it is: control characters (a newline would
    end a comment or a command), #SBATCH values with spaces or quotes, a job name that is
    a path, a memory size SLURM does not read."""
    values = [
        ("the recipe", spec.recipe),
        *(("--env", item) for item in spec.env),
        *(("--trust", item) for item in spec.trust),
        *(("an argument after the recipe", a) for a in spec.recipe_args),
    ]
    for what, value in values:
        if CONTROL.search(value):
            raise UsageError(
                f"{what} {value!r} holds a newline or another control character, which a "
                "script line cannot hold; nothing was written. Give the value on one line."
            )
    if not JOB_NAME.match(spec.job_name):
        raise UsageError(
            f"--job-name {spec.job_name!r}: a job name is letters, digits, '_', '-' and '.' "
            "(no '/', no spaces), since it also names the script file JOB_NAME.sbatch; "
            "nothing was written. Pick e.g. --job-name llama_ft (and -o PATH for the file)."
        )
    for flag, value in (
        ("--partition", spec.partition),
        ("--account", spec.account),
        ("--log", spec.log),
        ("--time", spec.time),
    ):
        if value is not None and not SBATCH_VALUE.match(value):
            raise UsageError(
                f"{flag} {value!r}: an #SBATCH value cannot hold spaces, quotes or other "
                "shell characters (sbatch reads those lines itself); nothing was written. "
                "Give a plain name or path."
            )
    for flag, value in (("--mem", spec.mem), ("--mem-per-gpu", spec.mem_per_gpu)):
        if value is not None and not MEMORY.match(value):
            raise UsageError(
                f"{flag} {value!r}: SLURM reads a memory size as a number with an optional "
                "unit K, M, G or T (e.g. 64G; --mem 0 is all of each node's memory)."
            )
    if spec.mem is not None and spec.mem_per_gpu is not None:
        raise UsageError("--mem and --mem-per-gpu both given: SLURM takes one of them; keep one.")


def check_shell_syntax(script: str, what: str) -> None:
    """`bash -n` over a script before it is written or printed: a script bash would not
    read is refused (no file is left behind)."""
    bash = shutil.which("bash")
    if bash is None:
        return
    result = subprocess.run([bash, "-n"], input=script, capture_output=True, text=True)
    if result.returncode != 0:
        detail = " ".join(result.stderr.split())
        raise UsageError(
            f"the {what} freetx wrote does not pass `bash -n` ({detail}); nothing was "
            "written. Check --setup: its lines go into the script as they are."
        )


def slurm_script(spec: LaunchSpec, command_line: str) -> str:
    """A batch script for `sbatch`: see the module docstring."""
    spec.check()
    lines = ["#!/bin/bash", f"# written by: {CONTROL.sub(' ', command_line)}"]
    sbatch = [
        f"--job-name={spec.job_name}",
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",  # one launcher per node; it starts the processes
        f"--cpus-per-task={spec.cpus}",
        f"--output={spec.log}",
        "--open-mode=append",  # a requeued job adds to the same log
        f"--signal=USR1@{spec.signal_seconds}",
        "--requeue",
    ]
    if spec.gpus_per_node:
        sbatch.append(f"--gpus-per-node={spec.gpus_per_node}")
    if spec.mem_per_gpu is None:
        sbatch.append(f"--mem={spec.mem if spec.mem is not None else '0'}")
    for flag, value in (
        ("partition", spec.partition),
        ("time", spec.time),
        ("account", spec.account),
        ("mem-per-gpu", spec.mem_per_gpu),
    ):
        if value is not None:
            sbatch.append(f"--{flag}={value}")
    lines += [f"#SBATCH {s}" for s in sbatch]
    if spec.workdir:
        lines += ["", f"cd {shlex.quote(spec.workdir)} || exit 1"]
    if spec.setup:
        lines += ["", "# set-up (before set -u: module and conda scripts read unset variables)"]
        lines += [spec.setup, "# end of set-up"]
    lines += ["", "set -uo pipefail"]
    if spec.env:
        lines += [""]
        for item in spec.env:
            name, value = item.split("=", 1)
            lines.append(f"export {name}={shlex.quote(value)}")
    lines += ["", *python_lines(spec)]
    port = '$("$python" -c ' + shlex.quote(FREE_PORT) + ")" if spec.port is None else str(spec.port)
    run = spec.freetx_run(
        "$python",
        "--nnodes", "$SLURM_JOB_NUM_NODES", "--nproc-per-node", str(spec.processes_per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "$head_node:$port",
        "--rdzv-id", "$SLURM_JOB_ID", "--max-restarts", str(spec.max_restarts),
    )  # fmt: skip
    # shell variables stay expandable ("$head_node:$port"); everything else is quoted
    quoted = " ".join(f'"{a}"' if a.startswith("$") else shlex.quote(a) for a in run)
    lines += [
        "",
        "# the first node of the allocation (where this script runs) hosts the rendezvous,",
        "# on a port free there now" if spec.port is None else "# on the port --port gave",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"port=${{FREETX_PORT:-{port}}}",
        'echo "freetx: job $SLURM_JOB_ID on $SLURM_JOB_NUM_NODES node(s), head $head_node, '
        'port $port, python $python, restart ${SLURM_RESTART_COUNT:-0}"',
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
    script = "\n".join(lines)
    check_shell_syntax(script, "SLURM script")
    return script


def python_lines(spec: LaunchSpec) -> list[str]:
    """Shell lines that set $python to an interpreter that imports freetx, found at run
    time after the set-up (see the module docstring), or stop with a message."""
    candidates = [spec.python] if spec.python is not None else ["python", "python3"]
    if spec.python is None and spec.fallback_python:
        candidates.append(spec.fallback_python)
    return [
        "# the Python that has freetx: FREETX_PYTHON, else the first of these that imports it and its dependencies",
        f"candidates=({' '.join(shlex.quote(c) for c in candidates)})",
        'if [ -n "${FREETX_PYTHON:-}" ]; then candidates=("$FREETX_PYTHON" "${candidates[@]}"); fi',
        "python=",
        'for candidate in "${candidates[@]}"; do',
        '  if "$candidate" -c "import torch, freetx.cli.main" 2>/dev/null; then',
        '    python=$(command -v "$candidate"); break  # the path, for the log',
        "  fi",
        "done",
        'if [ -z "$python" ]; then',
        '  echo "freetx: no Python on this node imports freetx (tried: ${candidates[*]}); '
        'activate its venv in --setup or export FREETX_PYTHON=/path/to/python" >&2',
        "  exit 1",
        "fi",
    ]


def torchrun_commands(spec: LaunchSpec, master_addr: str, node_rank: int | None) -> str:
    """The command each node runs (static rendezvous on `master_addr`), one per line."""
    spec.check()
    out = []
    for rank, command in node_commands(spec, master_addr, node_rank):
        out.append(f"# node {rank} of {spec.nodes}")
        out.append(command)
    return "\n".join(out) + "\n"


def node_commands(
    spec: LaunchSpec, master_addr: str, node_rank: int | None
) -> list[tuple[int, str]]:
    """(node rank, its command line, quoted) for every node, or for `node_rank`."""
    if node_rank is not None and not 0 <= node_rank < spec.nodes:
        raise UsageError(f"--node-rank {node_rank} is not in 0..{spec.nodes - 1}.")
    ranks = range(spec.nodes) if node_rank is None else [node_rank]
    out = []
    for rank in ranks:
        command = spec.freetx_run(
            spec.python or "python",
            "--nnodes", str(spec.nodes), "--node-rank", str(rank),
            "--nproc-per-node", str(spec.processes_per_node), "--master-addr", master_addr,
            "--master-port", str(spec.port or 29500), "--max-restarts", str(spec.max_restarts),
        )  # fmt: skip
        out.append((rank, " ".join(shlex.quote(a) for a in command)))
    return out


def torchrun_script(
    spec: LaunchSpec, master_addr: str, node_rank: int | None, command_line: str
) -> str:
    """`launch torchrun -o FILE`: a script that runs one node's command, the node's rank
    given as its argument (`bash FILE 0` on node 0) unless --node-rank fixed it."""
    spec.check()
    commands = node_commands(spec, master_addr, node_rank)
    lines = ["#!/bin/bash", f"# written by: {CONTROL.sub(' ', command_line)}", "set -euo pipefail"]
    if node_rank is not None:
        lines += [f"# node {node_rank} of {spec.nodes}", f"exec {commands[0][1]}"]
    else:
        last = spec.nodes - 1
        lines += [
            f"# on each of the {spec.nodes} nodes: bash THIS_FILE NODE_RANK (0 on node 0 "
            f"= {master_addr}, ... {last})",
            f'node_rank=${{1:?"give the node rank (0..{last}): bash $0 NODE_RANK"}}',
            'case "$node_rank" in',
            *[f"  {rank}) exec {command} ;;" for rank, command in commands],
            f'  *) echo "freetx: node rank $node_rank is not in 0..{last}" >&2; exit 2 ;;',
            "esac",
        ]
    script = "\n".join(lines) + "\n"
    check_shell_syntax(script, "torchrun script")
    return script

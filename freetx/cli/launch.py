"""`freetx launch slurm ...` and `freetx launch torchrun ...`: scripts and commands for
clusters (freetx/launch/scripts.py); the config is checked before anything is written,
and an existing script is replaced only with --overwrite."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from freetx.cli.common import add_trust_option, at_least_one, at_least_zero, port

INTERMIXED_ARGS = False
SLURM_TIME = re.compile(
    r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2})$"
)


HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$|^\[?[0-9A-Fa-f:.]+\]?$")


def host_name(value: str) -> str:
    """An argparse type: a host name (letters, digits, dots, hyphens) or an IP address."""
    if not HOST.match(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a host name or an IP address (e.g. node001 or 10.0.0.1)"
        )
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=at_least_one, default=1)
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs (= processes) per node")
    p.add_argument("--nproc-per-node", type=at_least_one, default=1, help="processes per CPU node")
    p.add_argument(
        "--port",
        "--master-port",
        type=port,
        default=None,
        help="the rendezvous port (torchrun's --master-port; default: slurm's "
        "script finds a free one on the head node at run time, torchrun 29500)",
    )
    p.add_argument(
        "--max-restarts",
        type=at_least_zero,
        default=0,
        help="torchrun restarts the group this often after a rank dies",
    )
    p.add_argument(
        "--python",
        default=None,
        help="the interpreter that has freetx (default: slurm's script uses "
        "FREETX_PYTHON, else the python on PATH after --setup, else this one; "
        "torchrun's commands this one)",
    )
    add_trust_option(p)
    p.add_argument("recipe", help="a built-in recipe name or a recipe .py file")
    p.add_argument("recipe_args", nargs=argparse.REMAINDER, help="--config CONFIG [key=value ...]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freetx launch", description="Run on clusters.")
    sub = p.add_subparsers(dest="where", metavar="WHERE", required=True)
    slurm = sub.add_parser("slurm", help="write (and submit) a SLURM batch script")
    _common(slurm)
    for flag in ("partition", "time", "account", "setup"):
        slurm.add_argument(f"--{flag}")
    slurm.add_argument("--mem", help="memory per node, e.g. 64G (default 0: all of the node's)")
    slurm.add_argument("--mem-per-gpu", help="memory per GPU instead of --mem, e.g. 80G")
    slurm.add_argument(
        "--cpus-per-task",
        type=at_least_one,
        help="CPUs per node (default: processes x (1 + the config's num_workers))",
    )
    slurm.add_argument("--job-name", default="freetx")
    slurm.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    slurm.add_argument(
        "--signal-seconds",
        type=at_least_one,
        default=90,
        help="SIGUSR1 this long before the time limit: save, then requeue",
    )
    slurm.add_argument("--log", default="slurm-%j.out", help="the job's log file")
    slurm.add_argument("-o", "--output", help="write the script here (default: print it)")
    slurm.add_argument("--submit", action="store_true", help="and submit it with sbatch")
    slurm.add_argument(
        "--overwrite", action="store_true", help="replace the script file if it exists"
    )
    torchrun = sub.add_parser("torchrun", help="print the torchrun command of every node")
    _common(torchrun)
    torchrun.add_argument(
        "--master-addr",
        required=True,
        type=host_name,
        help="the host of node 0: a host name or an IP address",
    )
    torchrun.add_argument("--node-rank", type=at_least_zero, help="only this node's command")
    torchrun.add_argument(
        "-o", "--output", help="write a script here (bash FILE NODE_RANK on each node)"
    )
    torchrun.add_argument(
        "--overwrite", action="store_true", help="replace the script file if it exists"
    )
    for parser in (slurm, torchrun):  # what refuse_options_after_recipe names
        options = {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}
        parser.set_defaults(launch_options=frozenset(options))
    return p


def _spec(args: argparse.Namespace):
    from freetx.cli.common import load_recipe
    from freetx.config.run_config import load_recipe_config, split_recipe_args
    from freetx.errors import FreetxError
    from freetx.launch import LaunchSpec

    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise FreetxError(
            f"--gpus-per-node {args.gpus_per_node}: a GPU node runs at least 1 process; for "
            "CPU nodes leave it out and give --nproc-per-node N."
        )
    refuse_options_after_recipe(args)
    config, overrides = split_recipe_args(args.recipe_args)
    target = load_recipe(args.recipe)
    cfg = load_recipe_config(config, overrides, target.schema)  # fails before writing
    spec = LaunchSpec(
        recipe=args.recipe,
        recipe_args=args.recipe_args,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node or 0,
        nproc_per_node=args.nproc_per_node,
        port=args.port,
        max_restarts=args.max_restarts,
        python=args.python,
        fallback_python=sys.executable,
        workdir=os.getcwd(),
        loader_workers=getattr(cfg, "num_workers", 0) or 0,
        trust=list(args.trust),
    )
    if args.where == "torchrun" and spec.python is None:
        spec.python = sys.executable
    from freetx.cli.common import config_device
    from freetx.distributed import Processes
    from freetx.training import check_layout

    # the refusals the ranks would make before their first step, before a script exists
    device = "cuda" if spec.gpus_per_node else config_device(getattr(cfg, "device", "auto"))
    per_node = spec.processes_per_node
    check_layout(cfg, Processes(spec.nodes * per_node, per_node, device))
    return spec


def refuse_options_after_recipe(args: argparse.Namespace) -> None:
    """`launch slurm RECIPE --config X -o F`: everything after the recipe goes to it, so
    a launch option there is named, with where it goes."""
    from freetx.errors import UsageError

    for arg in args.recipe_args:
        name = arg.split("=", 1)[0]
        if name in args.launch_options:
            raise UsageError(
                f"{name} comes after the recipe, where only --config and key=value "
                f"overrides go; `freetx launch {args.where}`'s options go before the recipe: "
                f"freetx launch {args.where} {name} ... {args.recipe} --config CONFIG "
                "[key=value ...]. Nothing was written."
            )


def main(args: argparse.Namespace) -> int:
    from freetx.errors import FreetxError
    from freetx.launch import slurm_script, torchrun_commands, torchrun_script
    from freetx.user_files import refuse_existing, write_user_file

    path = None  # the script file: -o, or JOB_NAME.sbatch to submit
    if args.where == "slurm" and args.submit and not args.output:
        path = Path(f"{args.job_name}.sbatch")
    if args.output:
        path = Path(args.output)
    if path is not None:
        refuse_existing(path, args.overwrite, "another -o FILE")
    if args.where == "slurm" and args.submit and shutil.which("sbatch") is None:
        raise FreetxError(
            "--submit runs sbatch, which is not on this machine's PATH (SLURM's client "
            "tools are missing here); nothing was written.",
        )
    spec = _spec(args)
    written_by = f"freetx launch {args.where} " + " ".join(map(shlex.quote, sys.argv[3:]))
    if args.where == "torchrun":
        if path is None:
            print(torchrun_commands(spec, args.master_addr, args.node_rank), end="")
            return 0
        script = torchrun_script(spec, args.master_addr, args.node_rank, written_by)
        write_user_file(path, script, args.overwrite, "another -o FILE")
        path.chmod(0o755)
        how = f"bash {shlex.quote(str(path))}" + (
            "" if args.node_rank is not None else " NODE_RANK (0 on node 0, 1 on node 1, ...)"
        )
        print(f"wrote {path}; on each node run: {how}")
        return 0
    if args.time is not None and not SLURM_TIME.match(args.time):
        raise FreetxError(
            f"--time {args.time}: SLURM reads minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
            "D-HH:MM:SS (e.g. 2-00:00:00 for two days)."
        )
    for field in (
        "partition",
        "account",
        "mem_per_gpu",
        "mem",
        "setup",
        "cpus_per_task",
        "job_name",
        "env",
        "signal_seconds",
        "log",
    ):
        setattr(spec, field, getattr(args, field))
    spec.time = args.time
    script = slurm_script(spec, written_by)
    if path is None:
        print(script, end="")
        return 0
    write_user_file(path, script, args.overwrite, "another -o FILE")
    if not args.submit:
        print(f"wrote {path}; submit it with: sbatch {path}")
        return 0
    result = subprocess.run(["sbatch", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        message = (result.stderr or result.stdout).strip().replace("\n", " ")
        raise FreetxError(f"sbatch refused {path}: {message}")
    print(result.stdout.strip())
    return 0

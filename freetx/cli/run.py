"""`freetx run [LAUNCH OPTIONS] RECIPE --config CONFIG [overrides]`.

Launch options are torchrun's own (its parser is used as is: --nproc-per-node,
--nnodes, --node-rank, --rdzv-endpoint, --rdzv-backend, --max-restarts,
--standalone, ...). With none, the recipe runs in this process with world size
1. The config is checked before anything is launched, so a typo costs no
start-up time on N processes.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import sys
import textwrap
from pathlib import Path

from freetx.errors import FreetxError
from freetx.launch.rendezvous import DEFAULT_TIMEOUT_S

DESCRIPTION = """Run a recipe (a built-in name or a path to a .py file) with a config (a
built-in name or a path to a .yaml file) and key=value overrides. Options before
RECIPE are torchrun's launch options; without them the recipe runs in this
process (world size 1).

examples:
  freetx run full_finetune_fsdp2 --config llm/tiny
  freetx run --nproc-per-node 2 full_finetune_fsdp2 --config llm/tiny max_steps=50
  freetx run --nnodes 2 --node-rank 0 --rdzv-endpoint host:29500 ./my_recipe.py --config ./my.yaml
"""


def _nodes(value: str) -> str:
    """torchrun's --nnodes: N, or MIN:MAX for an elastic job, each at least 1."""
    import argparse

    low, _, high = value.partition(":")
    if not (low.isdigit() and (high == "" or high.isdigit())):
        raise argparse.ArgumentTypeError(f"{value!r} is not N or MIN:MAX (whole numbers)")
    if int(low) < 1 or (high and int(high) < int(low)):
        raise argparse.ArgumentTypeError(f"{value}: nodes must be at least 1 (and MIN <= MAX)")
    return value


def _torchrun_parser():
    import argparse

    from torch.distributed.run import get_args_parser

    from freetx.cli.common import add_trust_option, at_least_zero, number, port

    # torchrun's numbers, checked here instead of by assertions (or not at all) in torchrun
    types = {
        "nnodes": _nodes,
        "max_restarts": at_least_zero,
        "node_rank": at_least_zero,
        "monitor_interval": number(float, above=0),
        "master_port": port,
        "shutdown_timeout": at_least_zero,
    }

    parser = get_args_parser()
    parser.prog = "freetx run"
    parser.usage = "freetx run [LAUNCH OPTIONS] RECIPE --config CONFIG [key=value ...]"
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for action in parser._actions:
        action.type = types.get(action.dest, action.type)
        if action.dest == "training_script":
            action.metavar = "RECIPE"
            action.help = "a built-in recipe name or a path to a recipe .py file"
        elif action.dest == "training_script_args":
            action.metavar = "--config CONFIG [key=value ...]"
            action.help = "the config (name or .yaml path) and overrides"
    add_trust_option(parser)
    parser.add_argument(
        "--rendezvous-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="freetx: on a node that does not host the rendezvous of a multi-node run, wait "
        "this long for it to answer before stopping with a message (default: %(default)g)",
    )
    return parser


def _launch_options(tokens: list[str]) -> list[str]:
    """The options before the recipe that launch processes: all but `--trust`'s."""
    kept, previous = [], None
    for token in tokens:
        if "--trust" not in (token, previous) and not token.startswith("--trust="):
            kept.append(token)
        previous = token
    return kept


def main(argv: list[str]) -> int:
    from freetx.cli.common import check_recipe_fits, config_owner_hint, load_recipe
    from freetx.config.loading import resolve_config_path
    from freetx.config.run_config import load_recipe_config, split_recipe_args
    from freetx.config.schema import config_as_dict
    from freetx.config.trust import add_trusted
    from freetx.errors import ConfigError
    from freetx.training import check_read_paths, check_written_folders
    from freetx.training.seed import deterministic_env

    parser = _torchrun_parser()
    args = parser.parse_args(argv)
    add_trusted(args.trust)  # this command's, and its ranks' (the environment)
    launch_tokens = _launch_options(argv[: len(argv) - len(args.training_script_args) - 1])

    config, overrides = split_recipe_args(args.training_script_args)
    target = load_recipe(args.training_script)
    try:
        cfg = load_recipe_config(config, overrides, target.schema)  # fail fast, before launching
    except ConfigError as e:
        hint = config_owner_hint(config, args.training_script)
        if hint is None:
            raise
        raise ConfigError([*e.problems, hint], fix=e.fix) from None
    check_recipe_fits(args.training_script, cfg)
    check_written_folders(cfg)  # a read-only output_dir or cache fails here, not on N ranks
    check_read_paths(cfg)  # a model_dir that is not there too
    config_path = resolve_config_path(config)
    script_args = ["--config", str(config_path), *overrides]
    output_dir = config_as_dict(cfg).get("output_dir")  # where a stopped run says so
    # `deterministic: true`: the ranks' environment, there before CUDA starts in them
    os.environ.update(deterministic_env(bool(config_as_dict(cfg).get("deterministic"))))

    if not launch_tokens:
        _check_layout(cfg, 1, 1)
        code = _run_in_process(target.path, script_args)
        return _preempted(output_dir, code)
    if not target.supports_distributed:
        raise FreetxError(
            f"recipe {target.name} runs on one process only, but launch options were given "
            f"({' '.join(launch_tokens)}); drop them: freetx run {target.name} --config {config}"
        )
    processes_per_node = _processes_per_node(args.nproc_per_node)
    low, _, high = str(args.nnodes).partition(":")
    if low.isdigit() and high in ("", low):  # N or N:N nodes (elastic M:N: known at start)
        _check_layout(cfg, int(low) * processes_per_node, processes_per_node)
    _check_rendezvous(args)
    args.training_script = str(target.path)
    args.training_script_args = script_args
    return _preempted(output_dir, _run_with_torchrun(args, processes_per_node))


def _check_rendezvous(args) -> None:
    """A multi-node run: the rendezvous host resolves, and a node that does not host the
    store reaches it within --rendezvous-timeout (freetx/launch/rendezvous.py), before
    any process starts. Node 0 of a static rendezvous (--master-addr) and the node named
    by a c10d --rdzv-endpoint host it: they only resolve the name."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    from torch.distributed.run import get_rdzv_endpoint

    from freetx.launch.rendezvous import resolve, split_endpoint, wait_for_rendezvous

    if not args.rendezvous_timeout > 0:
        raise FreetxError(
            f"--rendezvous-timeout {args.rendezvous_timeout:g}: give a number of seconds "
            f"above 0 (default {DEFAULT_TIMEOUT_S:g})."
        )
    endpoint = get_rdzv_endpoint(args)
    if str(args.nnodes) in ("1", "1:1") or args.standalone or not endpoint:
        return
    static = args.rdzv_backend == "static"
    host, port = split_endpoint(endpoint, 29500 if static else 29400)  # torchrun's defaults
    resolve(host, port)
    hosts_store = args.node_rank == 0 if static else _matches_machine_hostname(host)
    if not hosts_store and args.rdzv_backend in ("static", "c10d"):  # not etcd's
        wait_for_rendezvous(host, port, args.rendezvous_timeout)


def _check_layout(cfg, world_size: int, processes_per_node: int) -> None:
    """The refusals the ranks would make before their first step, made here before any
    process is launched (`freetx.training.check_layout`); the device is the one the
    ranks will find on this node."""
    import torch

    from freetx.cli.common import config_device
    from freetx.distributed import Processes
    from freetx.distributed.runtime import check_device
    from freetx.training import check_layout

    device = config_device(getattr(cfg, "device", "auto"))  # generate has no layout to check
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(device, processes_per_node)
    check_layout(cfg, Processes(world_size, processes_per_node, device))


def _preempted(output_dir: str | None, code: int) -> int:
    """When the run stopped on a signal after saving (it left PREEMPTED), say so in one
    line and exit with PREEMPTED_EXIT_CODE (75), which `freetx launch slurm`'s script
    answers with a requeue; 130 after Ctrl-C."""
    from freetx.errors import PREEMPTED_EXIT_CODE
    from freetx.training.signals import PREEMPTED_FILE

    marker = Path(output_dir) / PREEMPTED_FILE if output_dir else None
    if marker is None or not marker.is_file():
        return code
    note = marker.read_text().strip()
    marker.unlink(missing_ok=True)
    print(f"freetx run: stopped by {note}; run the same command to continue.", file=sys.stderr)
    return 130 if note.startswith("SIGINT") else PREEMPTED_EXIT_CODE


def _processes_per_node(value: str) -> int:
    """--nproc-per-node as a count: N >= 1, or auto | cpu | gpu | xpu as torchrun reads them."""
    from torch.distributed.run import determine_local_world_size

    try:
        count = determine_local_world_size(str(value))
    except ValueError as e:
        raise FreetxError(
            f"--nproc-per-node {value}: {str(e).rstrip('.')}. Give a number of processes "
            "(e.g. 2), or auto, cpu or gpu."
        ) from None
    if count < 1:
        raise FreetxError(
            f"--nproc-per-node {value}: a node needs at least 1 process. Give a number of "
            "processes (e.g. 2)."
        )
    return count


def _run_in_process(path: Path, script_args: list[str]) -> int:
    saved = sys.argv
    sys.argv = [str(path), *script_args]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def launch_module(module: str, module_args: list[str], processes: int) -> int:
    """`python -m MODULE ARGS` on `processes` local processes, launched as `freetx run`
    launches a recipe (torchrun standalone, one line per failed rank); the exit code."""
    args = _torchrun_parser().parse_args(
        ["--nproc-per-node", str(processes), "--module", module, *module_args]
    )
    return _run_with_torchrun(args, processes)


def _run_with_torchrun(args, processes_per_node: int) -> int:
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run as torchrun

    from freetx.errors import LAUNCHER_REPORTS_ERRORS

    # freetx prints the ranks' errors itself, each once (see _report_failure)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    single_node = str(args.nnodes) in ("1", "1:1")
    if single_node and not args.rdzv_endpoint:
        args.standalone = True  # a free local port; parallel runs do not collide
    if "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // processes_per_node)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ[LAUNCHER_REPORTS_ERRORS] = "1"
    # SLURM's --signal=USR1@90 reaches this process too: the ranks handle it (they save
    # at the next step boundary); torchrun's agent must not die of it
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        torchrun(args)
    except ChildFailedError as e:
        _report_failure(e)
        return 1
    except SignalException as e:  # SIGTERM / SIGINT to the launcher: the ranks were told
        name = signal.Signals(e.sigval).name
        print(f"freetx run: {name}: the ranks were stopped.", file=sys.stderr)
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        print("freetx run: interrupted: the ranks were stopped.", file=sys.stderr)
        return 130
    return 0


def _user_error(failure) -> str | None:
    """The message of a rank that stopped on a freetx user error, or None."""
    from freetx.errors import USER_ERROR_KEY

    try:
        with open(str(failure.error_file), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(record, dict) and record.get(USER_ERROR_KEY):
        return str(record.get("message", ""))
    return None


def _killed_by(failure) -> str | None:
    """The signal that ended a rank (exit -9, or 137 from a shell: SIGKILL), or None."""
    import signal

    code = failure.exitcode
    number = -code if code < 0 else code - 128 if 128 < code < 128 + 65 else None
    try:
        return signal.Signals(number).name if number else None
    except ValueError:
        return None


def _report_failure(error) -> None:
    """Name the ranks a signal killed first (SIGKILL: kill -9 or the out-of-memory killer;
    the others' messages are consequences), then print each distinct user error once
    (with the ranks that raised it), then a line for every rank that failed otherwise:
    its own first line, or its exit code.

    Ranks stopped as a consequence (torchrun's SIGTERM, or a broken collective)
    are left out.
    """
    import signal

    from freetx.errors import STOPPED_BY_PEER_EXIT_CODE, format_error, rank_list

    failures = sorted(error.failures.items())
    messages: dict[str, list[int]] = {}
    for rank, failure in failures:
        user_message = _user_error(failure)
        if user_message is not None:
            messages.setdefault(user_message, []).append(rank)
    stuck: list[int] = []
    if any("did not arrive" in m for m in messages):  # the hang guard: name the missing
        killed = (-signal.SIGTERM, -signal.SIGKILL)  # torchrun stops it, or kills it later
        stuck = [r for r, f in failures if f.exitcode in killed]
    signalled = {
        rank: _killed_by(f)
        for rank, f in failures
        if rank not in stuck
        and _killed_by(f) not in (None, "SIGTERM")
        and not os.path.isfile(str(f.error_file))
    }
    if signalled:
        hints = {"SIGKILL": ": kill -9, or the out-of-memory killer"}
        died = "; ".join(
            f"rank {r} was killed by {name} (exit code {error.failures[r].exitcode}"
            f"{hints.get(name, '')})"
            for r, name in signalled.items()
        )
        follow = "; their messages follow." if messages else "."
        text = f"freetx run: {died}. The other ranks stopped because of it{follow}"
        print(textwrap.fill(text, width=100, subsequent_indent="  "), file=sys.stderr)
    parts = []
    if stuck:
        parts.append(f"{rank_list(stuck)} never reached that collective and was stopped")
    for rank, failure in failures:
        if rank in stuck or rank in signalled or _user_error(failure) is not None:
            continue
        if os.path.isfile(str(failure.error_file)):
            message = failure.message
            if isinstance(message, dict):
                message = message.get("message", "")
            line = str(message).strip().splitlines()[0] if message else "no message"
            parts.append(f"rank {rank} failed ({line})")
        elif failure.exitcode in (-signal.SIGTERM, STOPPED_BY_PEER_EXIT_CODE):
            continue
        else:
            parts.append(f"rank {rank} exited with code {failure.exitcode} without a message")
    for message, ranks in messages.items():
        print(format_error(FreetxError(message), f"freetx [{rank_list(ranks)}]"), file=sys.stderr)
    if not parts and not messages and not signalled:
        rank, failure = error.get_first_failure()
        parts.append(f"rank {rank} ended with exit code {failure.exitcode}")
    if parts:
        print(
            "freetx run: " + "; ".join(parts) + ". Messages are above; the other ranks were "
            "stopped.",
            file=sys.stderr,
        )

"""`freetx run [LAUNCH OPTIONS] RECIPE --config CONFIG [overrides]`.

Launch options are torchrun's own (its parser is used as is: --nproc-per-node,
--nnodes, --node-rank, --rdzv-endpoint, --rdzv-backend, --max-restarts,
--standalone, ...). With none, the recipe runs in this process with world size
1. The config is checked before anything is launched, so a typo costs no
start-up time on N processes.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from pathlib import Path

from freetx.errors import FreetxError

DESCRIPTION = """Run a recipe (a built-in name or a path to a .py file) with a config (a
built-in name or a path to a .yaml file) and key=value overrides. Options before
RECIPE are torchrun's launch options; without them the recipe runs in this
process (world size 1).

examples:
  freetx run full_finetune_fsdp2 --config llm/tiny
  freetx run --nproc-per-node 2 full_finetune_fsdp2 --config llm/tiny max_steps=50
  freetx run --nnodes 2 --node-rank 0 --rdzv-endpoint host:29500 ./my_recipe.py --config ./my.yaml
"""


def _torchrun_parser():
    import argparse

    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "freetx run"
    parser.usage = "freetx run [LAUNCH OPTIONS] RECIPE --config CONFIG [key=value ...]"
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for action in parser._actions:
        if action.dest == "training_script":
            action.metavar = "RECIPE"
            action.help = "a built-in recipe name or a path to a recipe .py file"
        elif action.dest == "training_script_args":
            action.metavar = "--config CONFIG [key=value ...]"
            action.help = "the config (name or .yaml path) and overrides"
    return parser


def main(argv: list[str]) -> int:
    from freetx.cli.common import load_recipe
    from freetx.config.entry import load_recipe_config, split_recipe_args
    from freetx.config.loading import resolve_config_path

    parser = _torchrun_parser()
    args = parser.parse_args(argv)
    launch_tokens = argv[: len(argv) - len(args.training_script_args) - 1]

    config, overrides = split_recipe_args(args.training_script_args)
    target = load_recipe(args.training_script)
    load_recipe_config(config, overrides, target.schema)  # fail fast, before launching
    config_path = resolve_config_path(config)
    script_args = ["--config", str(config_path), *overrides]

    if not launch_tokens:
        return _run_in_process(target.path, script_args)
    if not target.supports_distributed:
        raise FreetxError(
            f"recipe {target.name} runs on one process only, but launch options were given "
            f"({' '.join(launch_tokens)}); drop them: freetx run {target.name} --config {config}"
        )
    args.training_script = str(target.path)
    args.training_script_args = script_args
    return _run_with_torchrun(args)


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


def _run_with_torchrun(args) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run as torchrun

    # freetx prints its own one-line summary of a failed job (see _describe_failure)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    single_node = str(args.nnodes) in ("1", "1:1")
    if single_node and not args.rdzv_endpoint:
        args.standalone = True  # a free local port; parallel runs do not collide
    if "OMP_NUM_THREADS" not in os.environ and str(args.nproc_per_node).isdigit():
        threads = max(1, (os.cpu_count() or 1) // int(args.nproc_per_node))
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        torchrun(args)
    except ChildFailedError as e:
        print(f"freetx run: {_describe_failure(e)}", file=sys.stderr)
        return 1
    return 0


def _describe_failure(error) -> str:
    """Every rank that failed by itself: its own first line, or how it died.

    Ranks that wrote an error file (freetx records every exception) show their
    message; a rank that died without one (killed, out of memory, a crash in C)
    shows its exit code. Ranks stopped as a consequence (torchrun's SIGTERM, or
    a broken collective) are left out.
    """
    import signal

    from freetx.errors import STOPPED_BY_PEER_EXIT_CODE

    parts = []
    for rank, failure in sorted(error.failures.items()):
        if os.path.isfile(str(failure.error_file)):
            message = failure.message
            if isinstance(message, dict):
                message = message.get("message", "")
            line = str(message).strip().splitlines()[0] if message else "no message"
            parts.append(f"rank {rank} failed ({line})")
        elif failure.exitcode in (-signal.SIGTERM, STOPPED_BY_PEER_EXIT_CODE):
            continue
        elif failure.exitcode < 0:
            parts.append(f"rank {rank} was killed by {failure.signal_name()}")
        else:
            parts.append(f"rank {rank} exited with code {failure.exitcode} without a message")
    if not parts:
        rank, failure = error.get_first_failure()
        parts.append(f"rank {rank} ended with exit code {failure.exitcode}")
    return "; ".join(parts) + ". Messages are above; the other ranks were stopped."

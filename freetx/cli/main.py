"""`freetx`: list, copy, print, validate and run recipes.

Each subcommand lives in its own module with `build_parser()` and
`main(args) -> exit code`; modules import heavy packages (torch, omegaconf)
only inside `main`, so `freetx --help` and `freetx ls` answer at once.
Arguments may be mixed freely: `freetx validate CFG k=v --recipe R k2=v2`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from freetx import __version__
from freetx.errors import FreetxError, debug_enabled, files_errors_explained, report_error
from freetx.noise import quiet_known_noise

SUBCOMMANDS = {
    "ls": "list the built-in recipes and their configs",
    "cp": "copy a built-in recipe or config to a local file",
    "cat": "print a config, overrides applied and interpolations resolved",
    "validate": "check a config against its recipe's schema and components",
    "run": "run a recipe, in this process or on N processes via torchrun",
    "eval": "evaluate a checkpoint: lm-eval tasks, perplexity, rewards (the eval recipe)",
    "checkpoint": "inspect, convert or merge checkpoints (DCP, safetensors, torch, HF, PEFT)",
    "spectrum": "score a model's weight matrices and choose the ones Spectrum trains",
    "crosscoder": "analyze (model diffing) or export a crosscoder checkpoint",
    "launch": "write a SLURM batch script, or the torchrun command of every node",
    "estimate": "memory per rank and step time of a config for every strategy",
    "import": "print the freetx overrides an old config means (DeepSpeed, torchtune, axolotl, TRL, ...)",
    "doctor": "check this machine before a run: torch, GPUs, NCCL, collective bandwidth, disk",
    "data": "prepare a config's data: tokenize its dataset into the token cache",
}
MODULES = {
    "import": "import_config",
    "eval": "evaluate",
}  # a subcommand whose module has another name

EPILOG = """examples:
  freetx ls
  freetx cp full_finetune_fsdp2 ./my_recipe.py
  freetx cat llm/tiny max_steps=10
  freetx validate llm/tiny batch_size=4
  freetx run full_finetune_fsdp2 --config llm/tiny
  freetx run --nproc-per-node 2 ./my_recipe.py --config ./my.yaml max_steps=50
  freetx eval runs/llm_tiny --tasks my_task --include-path tasks/
  freetx checkpoint inspect runs/llm_tiny/checkpoints/step_000120
  freetx checkpoint convert runs/llm_tiny/checkpoints/step_000120 model.safetensors
  freetx launch slurm --nodes 4 --gpus-per-node 8 full_finetune_fsdp2 --config llm/llama3_8b

A user error prints one paragraph and exits 1 (2 for usage); --debug or
FREETX_DEBUG=1 shows the traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="freetx",
        description="Declarative recipes for distributed PyTorch training.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"freetx {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def _split_global(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """(global flags, subcommand, its arguments)."""
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            return argv[:i], arg, argv[i + 1 :]
    return argv, None, []


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_known_noise()
    global_flags, command, rest = _split_global(argv)
    if "--debug" in global_flags:
        os.environ["FREETX_DEBUG"] = "1"  # children (torchrun workers) inherit it
    try:
        with files_errors_explained():
            return _dispatch(argv, command, rest)
    except FreetxError as e:
        if debug_enabled():
            traceback.print_exc()
        return report_error(e)
    except KeyboardInterrupt:
        return 130


def _dispatch(argv: list[str], command: str | None, rest: list[str]) -> int:
    """Run the subcommand; its exit code."""
    if command == "run":
        # `run` takes torchrun's launch options before the recipe, so it
        # parses its own arguments with torchrun's parser.
        from freetx.cli import run

        return run.main(rest)
    if command in SUBCOMMANDS:
        module = importlib.import_module(f"freetx.cli.{MODULES.get(command, command)}")
        if hasattr(module, "parse_args"):  # a module that passes arguments on (import trl)
            return module.main(module.parse_args(rest))
        parser = module.build_parser()
        # intermixed parsing lets options follow overrides; parsers with
        # sub-actions (checkpoint inspect/convert) cannot use it
        intermixed = getattr(module, "INTERMIXED_ARGS", True)
        args = parser.parse_intermixed_args(rest) if intermixed else parser.parse_args(rest)
        if getattr(args, "trust", None):
            from freetx.config.trust import add_trusted

            add_trusted(args.trust)  # this command's, and its ranks' (the environment)
        return module.main(args)
    parser = build_parser()
    parser.parse_args(argv)  # --help, --version, or an unknown command (exit 2)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())

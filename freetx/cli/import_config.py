"""`freetx import deepspeed|accelerate|fsdp FILE [--world-size N]`: the freetx overrides
an old config means (freetx/planning/config_import.py holds the mapping)."""

from __future__ import annotations

import argparse
import shlex

from freetx.cli.common import at_least_one

FORMATS = ("deepspeed", "accelerate", "fsdp-config")  # what freetx.planning.config_import reads
DESCRIPTION = """Read an old config and print the freetx overrides it means, ready to paste
after `freetx run RECIPE --config CFG`, then (as # comments) the launch options and
environment it asks for, and every key with no freetx equivalent and why.

  deepspeed   a DeepSpeed JSON (ds_config.json: zero_optimization, bf16, batch sizes)
  accelerate  accelerate's YAML (default_config.yaml: distributed_type, fsdp_config, ...)
  fsdp-config the seeds' FSDP JSON (fsdp_* keys) or training YAML (distributed:, training:)

freetx's batch_size is global (samples per optimizer step over all ranks): a per-GPU
micro-batch is multiplied by gradient_accumulation_steps and --world-size.

examples:
  freetx import deepspeed config/ds_config.json --world-size 8
  freetx import accelerate ~/.cache/huggingface/accelerate/default_config.yaml
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="freetx import",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("format", choices=FORMATS, help="the system the file is from")
    parser.add_argument("file", help="the config file (.json read as JSON, else YAML)")
    parser.add_argument(
        "--world-size",
        type=at_least_one,
        default=None,
        help="the GPUs the old run used, where the file does not say (per-GPU batch sizes)",
    )
    return parser


def main(args: argparse.Namespace) -> int:
    from freetx.planning.config_import import import_config, read_config_file

    found = import_config(args.format, read_config_file(args.file), args.world_size)
    print(" ".join(shlex.quote(a) for a in found.override_args()))
    print(f"# the overrides {args.file} means: freetx run RECIPE --config CFG <the line above>")
    if found.launch:
        print(f"# launch options (before RECIPE): {' '.join(found.launch)}")
    for name, value in found.environment.items():
        print(f"# environment: export {name}={shlex.quote(value)}")
    for note in found.notes:
        print(f"# note: {note}")
    if found.unmapped:
        print(f"# {len(found.unmapped)} keys with no freetx equivalent:")
        for key, why in found.unmapped:
            print(f"#   {key}: {why}")
    return 0

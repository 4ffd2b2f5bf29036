"""`freetx import deepspeed|accelerate|fsdp FILE [--world-size N]`: the freetx overrides
an old config means (freetx/planning/config_import.py reads the file; a module per format
holds its mapping: deepspeed_import.py, accelerate_import.py, fsdp_import.py,
torchtune_import.py)."""

from __future__ import annotations

import argparse
import shlex

from freetx.cli.common import at_least_one

FORMATS = ("deepspeed", "accelerate", "fsdp-config", "torchtune")  # freetx.planning's importers
DESCRIPTION = """Read an old config and print the freetx overrides it means, ready to paste
after `freetx run RECIPE --config CFG`, then (as # comments) the launch options and
environment it asks for, and every key with no freetx equivalent and why.

  deepspeed   a DeepSpeed JSON (ds_config.json: zero_optimization, bf16, batch sizes)
  accelerate  accelerate's YAML (default_config.yaml: distributed_type, fsdp_config, ...)
  fsdp-config the seeds' FSDP JSON (fsdp_* keys) or training YAML (distributed:, training:)
  torchtune   a torchtune recipe YAML (model, tokenizer, checkpointer, dataset, optimizer,
              batch_size, epochs, dtype, LoRA ...); --dataset-size N turns epochs into steps

freetx's batch_size is global (samples per optimizer step over all ranks): a per-GPU
micro-batch is multiplied by gradient_accumulation_steps and --world-size.

Values no setting can mean (negative, huge, NaN, not a number, a list for a number) are
refused with one paragraph and nothing is printed; YAML aliases are refused.

examples:
  freetx import deepspeed config/ds_config.json --world-size 8
  freetx import accelerate ~/.cache/huggingface/accelerate/default_config.yaml
  freetx import torchtune 8B_lora.yaml --world-size 8 --dataset-size 52002
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
    parser.add_argument(
        "--dataset-size",
        type=at_least_one,
        default=None,
        help="torchtune: the training samples per epoch, to turn epochs into max_steps",
    )
    return parser


def main(args: argparse.Namespace) -> int:
    from freetx.planning.config_import import import_config, read_config_file
    from freetx.planning.torchtune_import import import_torchtune

    data = read_config_file(args.file)
    if args.format == "torchtune":
        found = import_torchtune(data, args.world_size, args.file, args.dataset_size)
    else:
        found = import_config(args.format, data, args.world_size, args.file)
    print(" ".join(shlex.quote(a) for a in found.override_args()))
    meaning = f"the overrides {args.file} means: freetx run {found.recipe} --config {found.config}"
    print(comment(f"{meaning} <the line above>"))
    if found.launch:
        launch = " ".join(shlex.quote(a) for a in found.launch)
        print(comment(f"launch options (before RECIPE): {launch}"))
    for name, value in found.environment.items():
        print(comment(f"environment: export {name}={shlex.quote(value)}"))
    for note in found.notes:
        print(comment(f"note: {note}"))
    if found.unmapped:
        print(comment(f"{len(found.unmapped)} keys with no freetx equivalent:"))
        for key, why in found.unmapped:
            print(comment(f"  {key}: {why}"))
    return 0


def comment(text: str) -> str:
    """A `# ` line: a newline or other control character in a key or value from the file
    is shown escaped, so it cannot end the comment and start a command."""
    return "# " + "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text
    )

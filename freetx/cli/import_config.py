"""`freetx import deepspeed|accelerate|fsdp-config|torchtune|axolotl|trl FILE [--world-size
N]`: the freetx overrides an old config means (freetx/planning/config_import.py reads the
file; a module per format holds its mapping: deepspeed_import.py, accelerate_import.py,
fsdp_import.py, torchtune_import.py, axolotl_import.py, trl_import.py). `freetx import trl
sft|dpo|grpo ARGS...` reads the `trl` CLI's arguments instead of a file."""

from __future__ import annotations

import argparse
import shlex

from freetx.cli.common import at_least_one

# freetx.planning's importers
FORMATS = ("deepspeed", "accelerate", "fsdp-config", "torchtune", "axolotl", "trl")
TRL_KINDS = ("sft", "dpo", "grpo", "kto")  # `freetx import trl KIND ARGS...` (kto: refused)
DESCRIPTION = """Read an old config and print the freetx overrides it means, ready to paste
after `freetx run RECIPE --config CFG`, then (as # comments) the launch options and
environment it asks for, and every key with no freetx equivalent and why.

  deepspeed   a DeepSpeed JSON (ds_config.json: zero_optimization, bf16, batch sizes)
  accelerate  accelerate's YAML (default_config.yaml: distributed_type, fsdp_config, ...)
  fsdp-config the seeds' FSDP JSON (fsdp_* keys) or training YAML (distributed:, training:)
  torchtune   a torchtune recipe YAML (model, tokenizer, checkpointer, dataset, optimizer,
              batch_size, epochs, dtype, LoRA ...); --dataset-size N turns epochs into steps
  axolotl     an axolotl YAML (base_model, datasets, adapter: lora/qlora, rl: dpo/grpo, ...)
  trl         a TRL SFTConfig, DPOConfig or GRPOConfig as YAML (the kind from its keys), or
              the trl CLI's arguments: freetx import trl sft|dpo|grpo [--config FILE] ARGS...

freetx's batch_size is global (samples per optimizer step over all ranks): a per-GPU
micro-batch is multiplied by gradient_accumulation_steps and --world-size.

Values no setting can mean (negative, huge, NaN, not a number, a list for a number) are
refused with one paragraph and nothing is printed; YAML aliases are refused.

examples:
  freetx import deepspeed config/ds_config.json --world-size 8
  freetx import accelerate ~/.cache/huggingface/accelerate/default_config.yaml
  freetx import torchtune 8B_lora.yaml --world-size 8 --dataset-size 52002
  freetx import axolotl examples/llama-3/qlora-1b.yml --world-size 1
  freetx import trl grpo --config grpo.yaml --learning_rate 1e-6 --world-size 8
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="freetx import",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # the trl CLI's --dataset_name is not --dataset-size
    )
    parser.add_argument("format", choices=FORMATS, help="the system the file is from")
    parser.add_argument(
        "file",
        help="the config file (.json read as JSON, else YAML); trl: or sft, dpo, grpo and "
        "the trl CLI's arguments",
    )
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
        help="torchtune, axolotl, trl: the training samples per epoch, to turn epochs into "
        "max_steps",
    )
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """freetx's arguments; after `trl sft|dpo|grpo`, what is left are the trl CLI's
    (`args.trl_args`), anything left otherwise is refused."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    args.trl_args = None
    if args.format == "trl" and args.file in TRL_KINDS:
        args.trl_args = rest
    elif rest:
        parser.error(
            f"unrecognized arguments: {' '.join(rest)}"
            + (
                " (the trl CLI's arguments follow the trainer: freetx import trl sft|dpo|grpo "
                "--config FILE ARGS...)"
                if args.format == "trl"
                else ""
            )
        )
    return args


def main(args: argparse.Namespace) -> int:
    from freetx.planning.axolotl_import import import_axolotl
    from freetx.planning.config_import import import_config, read_config_file
    from freetx.planning.torchtune_import import import_torchtune
    from freetx.planning.trl_import import check_kind, import_trl, trl_cli_args

    size = args.dataset_size
    source = args.file
    if args.trl_args is not None:
        source = f"`trl {args.file}`'s arguments"
        check_kind(args.file, source)
        found = import_trl(
            trl_cli_args(args.file, args.trl_args), args.file, args.world_size, source, size
        )
    elif args.format == "trl":
        found = import_trl(read_config_file(args.file), None, args.world_size, source, size)
    elif args.format == "axolotl":
        found = import_axolotl(read_config_file(args.file), args.world_size, source, size)
    elif args.format == "torchtune":
        found = import_torchtune(read_config_file(args.file), args.world_size, source, size)
    else:
        found = import_config(args.format, read_config_file(args.file), args.world_size, source)
    print(" ".join(shlex.quote(a) for a in found.override_args()))
    meaning = f"the overrides {source} means: freetx run {found.recipe} --config {found.config}"
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

"""`freetx checkpoint inspect PATH`, `freetx checkpoint convert SRC DST` and
`freetx checkpoint merge CKPT --base BASE DST`.

What a conversion needs from the run that saved the checkpoint (the folders it
started from, its LoRA settings) is read here, from the config its meta.json
records, and passed to `freetx.checkpoint`, which reads no recipe's config.
"""

from __future__ import annotations

import argparse

INTERMIXED_ARGS = False  # sub-actions (inspect, convert) need plain parsing


def build_parser() -> argparse.ArgumentParser:
    from freetx.checkpoint.convert import FORMATS
    from freetx.distributed.parallelize import DTYPE_ABBREVIATIONS

    p = argparse.ArgumentParser(
        prog="freetx checkpoint",
        description="Look into checkpoints and convert them. No process group needed.",
    )
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    inspect = sub.add_parser(
        "inspect",
        help="step, world size, strategy, model class and every tensor of a checkpoint",
        description="Works on DCP folders, HF-style folders, .safetensors and torch.save files.",
    )
    inspect.add_argument("path")
    convert = sub.add_parser(
        "convert",
        help="convert between DCP, safetensors, torch.save and HF-style folders",
        description=(
            "Convert a checkpoint. The format comes from DST's suffix (.safetensors, .pt) "
            "unless --to says. safetensors, hf and peft (a LoRA run's adapters) hold the model only; torch and dcp hold "
            "everything unless --model-only. DCP -> safetensors streams tensor by tensor. "
            "DST is written under a temporary name and renamed when complete; an existing "
            "DST is replaced only with --overwrite."
        ),
    )
    convert.add_argument("src", help="DCP folder, HF folder, .safetensors or torch file")
    convert.add_argument("dst", help="output file or folder")
    convert.add_argument("--to", choices=FORMATS, help="output format (default: from DST)")
    convert.add_argument(
        "--dtype", choices=tuple(DTYPE_ABBREVIATIONS), help="cast floating tensors"
    )
    convert.add_argument(
        "--model-only", action="store_true", help="leave out optimizer and other state"
    )
    convert.add_argument(
        "--max-shard-size",
        default="5GB",
        help="--to hf: the largest weight file (e.g. 5GB, 500MB); more go in shards with an "
        "index (default 5GB)",
    )
    convert.add_argument(
        "--hf-files-from",
        metavar="DIR",
        help="--to hf: the HF folder whose tokenizer files and generation_config.json go "
        "beside the weights (default: the folder the run started from, if its config names one)",
    )
    convert.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DST if it exists (never allowed when DST is, holds or lies in SRC)",
    )
    merge = sub.add_parser(
        "merge",
        help="an HF folder of a base model with a LoRA / DoRA checkpoint's adapters merged in",
        description="Merge the adapters of CKPT into the weights of BASE (an HF folder, DCP "
        "checkpoint or .safetensors) and write an HF folder: sharded weights, config.json, "
        "and the base's tokenizer files. Streams one tensor at a time.",
    )
    merge.add_argument("checkpoint", help="a LoRA run's checkpoint (or its output_dir)")
    merge.add_argument("--base", required=True, help="the base the adapters were trained on")
    merge.add_argument("dst", help="the HF folder to write")
    merge.add_argument("--max-shard-size", default="5GB", help="largest weight file (default 5GB)")
    merge.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    return p


def main(args: argparse.Namespace) -> int:
    from freetx.checkpoint import convert, inspect_report, merge
    from freetx.training.export import recorded_run

    if args.action == "inspect":
        print(inspect_report(args.path))
        return 0
    if args.action == "merge":
        lora = recorded_run(args.checkpoint)["lora"]
        result = merge(args.checkpoint, args.base, args.dst, overwrite=args.overwrite,
                       max_shard_size=args.max_shard_size, lora=lora)  # fmt: skip
        print(f"Wrote {result['path']} (hf, adapters merged): {result['tensors']} tensors, "
              f"{result['bytes'] / 2**20:.1f} MiB")  # fmt: skip
        for note in result["notes"]:  # what the folder is, what was not read
            print(note)
        return 0
    result = convert(
        args.src, args.dst, to=args.to, dtype=args.dtype, model_only=args.model_only,
        overwrite=args.overwrite, max_shard_size=args.max_shard_size,
        hf_files_from=args.hf_files_from, **recorded_run(args.src),
    )  # fmt: skip
    print(
        f"Wrote {result['path']} ({result['format']}): {result['tensors']} tensors, "
        f"{result['bytes'] / 2**20:.1f} MiB"
    )
    for note in result["notes"]:
        print(note)
    return 0

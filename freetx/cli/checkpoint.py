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
    from freetx.distributed.config import DTYPE_ABBREVIATIONS

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
    convert.add_argument(
        "--quantize",
        metavar="SCHEME",
        help="an HF folder of torchao's quantized weights that transformers loads: "
        "int8_dynamic_act_int4_weight (8da4w; any device) or int4_weight (a CUDA machine). "
        "From a QAT run it converts what QAT trained; from any other run it is post-training "
        "quantization (a LoRA run: its adapters merged in)",
    )
    convert.add_argument(
        "--group-size",
        type=int,
        help="--quantize: input columns per int4 weight scale (default: the run's "
        "qat.group_size, else 32)",
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
        result = merge(
            args.checkpoint,
            args.base,
            args.dst,
            overwrite=args.overwrite,
            max_shard_size=args.max_shard_size,
            lora=lora,
        )
        return said(result, "hf, adapters merged")
    if args.quantize is not None or args.group_size is not None:
        return quantize(args)
    result = convert(
        args.src,
        args.dst,
        to=args.to,
        dtype=args.dtype,
        model_only=args.model_only,
        overwrite=args.overwrite,
        max_shard_size=args.max_shard_size,
        hf_files_from=args.hf_files_from,
        **recorded_run(args.src),
    )
    return said(result, result["format"])


def said(result: dict, kind: str) -> int:
    """What a conversion wrote (its path, `kind`, tensors, size) and its notes (what the
    folder is, what was not read); the exit code 0."""
    print(
        f"Wrote {result['path']} ({kind}): {result['tensors']} tensors, "
        f"{result['bytes'] / 2**20:.1f} MiB"
    )
    for note in result["notes"]:
        print(note)
    return 0


def quantize(args: argparse.Namespace) -> int:
    """`convert --quantize SCHEME`: an HF folder of torchao's quantized weights."""
    from freetx.checkpoint.quantized import export_quantized
    from freetx.errors import ConfigError
    from freetx.models.qat import QuantScheme
    from freetx.training.export import recorded_qat, recorded_run

    if args.quantize is None:
        raise ConfigError("--group-size sizes the groups of --quantize; add --quantize SCHEME.")
    if args.to not in (None, "hf") or args.dtype or args.model_only:
        raise ConfigError(
            "--quantize writes an HF folder of quantized weights (the weights' dtype stays the "
            "model's; only the model is written); leave out --to, --dtype and --model-only."
        )
    group_size = args.group_size or recorded_qat(args.src).group_size
    quant = QuantScheme.named(args.quantize, group_size)  # checked once, here
    result = export_quantized(
        args.src,
        args.dst,
        quant,
        overwrite=args.overwrite,
        hf_files_from=args.hf_files_from,
        **recorded_run(args.src),
    )
    return said(result, f"hf, {quant.scheme} in groups of {quant.group_size}")

"""`freetx crosscoder analyze CKPT` and `freetx crosscoder export CKPT OUT`.

analyze: model diffing from a crosscoder checkpoint's decoder: the relative decoder
norm of each feature between two sources (a histogram as PNG and in TensorBoard),
the counts of A-only, B-only and shared features, the decoder cosine of the shared
ones, into analysis.json (an earlier analysis there is refused unless --overwrite);
every source against source 0 (or the one pair --sources names), figures printed to 4
significant digits.
export: the crosscoder as one safetensors file with the input normalization folded
into its weights (it reads raw activations) and a config.json naming its sources.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from freetx.cli.common import at_least_zero

INTERMIXED_ARGS = False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freetx crosscoder", description="Crosscoder checkpoints.")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    analyze = sub.add_parser("analyze", help="model diffing: relative decoder norms and more")
    analyze.add_argument("checkpoint", help="a crosscoder run's output_dir or a checkpoint")
    analyze.add_argument("-o", "--output", help="folder (default: RUN/analysis)")
    analyze.add_argument(
        "--sources",
        nargs=2,
        type=at_least_zero,
        default=None,
        metavar=("A", "B"),
        help="one pair of sources to compare (default: each source against source 0)",
    )
    analyze.add_argument(
        "--overwrite", action="store_true", help="replace an earlier analysis in the folder"
    )
    export = sub.add_parser("export", help="safetensors + config.json, normalization folded in")
    export.add_argument("checkpoint")
    export.add_argument("output", help="the folder to write")
    export.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    return p


def _tensors(checkpoint: str):
    from freetx.checkpoint import open_tensors, resolve_checkpoint
    from freetx.errors import CheckpointError

    source = open_tensors(resolve_checkpoint(checkpoint))
    if "model.W_dec" not in source.infos:
        raise CheckpointError(f"{checkpoint} is not a crosscoder checkpoint (no W_dec).")
    return source


def main(args: argparse.Namespace) -> int:
    if args.action == "analyze":
        return analyze(args)
    return export(args)


def analyze(args: argparse.Namespace) -> int:
    from freetx.errors import FreetxError
    from freetx.loggers.charts import histogram_png
    from freetx.models.crosscoder import diffing_analysis, relative_decoder_norm
    from freetx.user_files import refuse_existing, write_user_file

    run = Path(args.checkpoint).expanduser()
    if args.output:
        out = Path(args.output)
    elif (run / "checkpoints").is_dir():
        out = run / "analysis"
    else:
        out = run.parent / f"{run.name}_analysis"
    files = [out / "analysis.json", out / "relative_decoder_norm.png"]
    for file in files:  # before reading the checkpoint
        refuse_existing(file, args.overwrite, "another -o FOLDER")
    source = _tensors(args.checkpoint)
    n = source.infos["model.W_dec"].shape[1]
    if n < 2:
        raise FreetxError(f"{args.checkpoint} is a crosscoder of one source: nothing to compare.")
    if args.sources is None:  # every source, each against the first
        pairs = [(0, b) for b in range(1, n)]
        compared = "each source against source 0"
    else:
        a, b = args.sources
        if not (0 <= a < n and 0 <= b < n) or a == b:
            raise FreetxError(
                f"--sources {a} {b}: the crosscoder reads {n} sources (0 to {n - 1}); give "
                "two different ones."
            )
        pairs, compared = [(a, b)], f"source {b} against source {a}"
    pngs = [files[1]] + [out / f"relative_decoder_norm_{a}_vs_{b}.png" for a, b in pairs[1:]]
    for file in pngs[1:]:  # before reading the decoder
        refuse_existing(file, args.overwrite, "another -o FOLDER")
    decoder = source.get("model.W_dec")
    results = [diffing_analysis(decoder, a, b) for a, b in pairs]
    # the first pair's figures at the top (as with two sources), every pair in `pairs`
    result = {**results[0], "compared": compared, "pairs": results}
    result["checkpoint"] = str(source.path)
    write_user_file(files[0], json.dumps(result, indent=2), args.overwrite)
    for png, each in zip(pngs, results):
        write_user_file(
            png, histogram_png(each["relative_norm_histogram"]["counts"]), args.overwrite
        )
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(out / "tb")) as writer:
        for png, (a, b) in zip(pngs, pairs):
            writer.add_histogram(
                png.stem,
                relative_decoder_norm(decoder, a, b),
                global_step=source.meta.get("step", 0),
            )
    print(f"{result['features']} features, {n} sources: {compared}")
    for (a, b), each in zip(pairs, results):
        cosine = each["shared_decoder_cosine_mean"]
        cosine_text = "n/a" if cosine is None else f"{cosine:.4g}"
        print(
            f"  source {b} vs {a}: {each['a_only']} only in source {a}, {each['b_only']} only "
            f"in source {b}, {each['shared']} shared (decoder cosine {cosine_text})"
        )
    print(f"-> {out}/analysis.json, {', '.join(p.name for p in pngs)}, tb/")
    return 0


def export(args: argparse.Namespace) -> int:
    from freetx.models.crosscoder import exported_tensors
    from freetx.user_files import check_destination, staged_output

    source = _tensors(args.checkpoint)
    dst = Path(args.output).expanduser()
    check_destination(source.path, dst, args.overwrite)  # before reading the tensors
    names = ("W_enc", "W_dec", "b_enc", "b_dec", "input_scale", "log_threshold",
             "inference_threshold")  # fmt: skip
    config = dict(source.model_config or {})
    tensors = exported_tensors(
        {name: source.get(f"model.{name}") for name in names if f"model.{name}" in source.infos},
        bool(config.get("apply_b_dec_to_input", False)),
    )
    folded = "model.input_scale" in source.infos
    scale = source.get("model.input_scale").float().tolist() if folded else None
    run_config = source.meta.get("config") or {}
    activations = run_config.get("activations") or {}
    description = {
        "crosscoder": config,
        "sources": activations.get("sources")
        if activations.get("kind") == "models"
        else "synthetic",
        "input_scale_folded": scale or [1.0] * tensors["W_enc"].shape[0],
        "computes": "f = act(sum_s x_s @ W_enc[s] + b_enc), act thresholded at `threshold` "
        "(jumprelu, batchtopk) or ReLU; x_hat = f @ W_dec + b_dec (per source), on raw "
        "activations (the input scale and any centering folded in)",
        "checkpoint": str(source.path),
    }
    from freetx.checkpoint.formats import save_tensors

    with staged_output(dst) as folder:
        folder.mkdir(parents=True, exist_ok=True)
        save_tensors(tensors, folder / "crosscoder.safetensors")
        (folder / "config.json").write_text(json.dumps(description, indent=2))
    print(f"Wrote {dst}: crosscoder.safetensors ({', '.join(tensors)}) and config.json")
    return 0

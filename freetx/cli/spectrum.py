"""`freetx spectrum scan MODEL --top-percent 25`: choose the modules Spectrum trains.

MODEL is an HF folder, a run's output_dir, a DCP checkpoint or a .safetensors
file. Every weight matrix of the repeated blocks is scored (the SNR of its
singular values against the Marchenko-Pastur edge, freetx/models/peft/spectrum.py);
with `--nproc-per-node N` the matrices are split over N processes. The scores
are cached beside the model (`spectrum_scores.json`) with the identity of the weights
they were computed from (the checkpoint MODEL meant, its files' sizes and times), so
another --top-percent costs nothing, and a model that trained on since is scanned again; the selection goes to MODEL/spectrum_top<P>.yaml (or -o FILE)
for `peft.method=spectrum peft.spectrum_selection=FILE`. An existing selection file
(perhaps edited by hand) is refused before scanning, unless --overwrite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from freetx.cli.common import at_least_one, number

INTERMIXED_ARGS = False
CACHE_NAME = "spectrum_scores.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="freetx spectrum", description="Spectrum: which modules to train fully."
    )
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    scan = sub.add_parser("scan", help="score every weight matrix and write a selection")
    scan.add_argument(
        "model", help="an HF folder, a run's output_dir, a DCP checkpoint, .safetensors"
    )
    scan.add_argument(
        "--top-percent",
        type=number(float, above=0, at_most=100),
        default=25.0,
        help="of each kind, in (0, 100] (default 25)",
    )
    scan.add_argument(
        "-o", "--output", help="the selection file (default: MODEL/spectrum_top<P>.yaml)"
    )
    scan.add_argument(
        "--nproc-per-node", type=at_least_one, default=1, help="processes to split the work over"
    )
    scan.add_argument("--rescan", action="store_true", help="ignore cached scores")
    scan.add_argument(
        "--overwrite", action="store_true", help="replace the selection file if it exists"
    )
    return p


def _beside(model: Path) -> Path:
    return model if model.is_dir() else model.parent


def main(args: argparse.Namespace) -> int:
    from freetx.checkpoint.identity import input_identity
    from freetx.errors import FreetxError
    from freetx.models.peft.spectrum import select, selected_share, selection_text
    from freetx.user_files import refuse_existing, write_user_file

    model = Path(args.model).expanduser()
    if not model.exists():
        raise FreetxError(f"{args.model} does not exist; give a model folder or checkpoint.")
    out = (
        Path(args.output)
        if args.output
        else _beside(model) / f"spectrum_top{args.top_percent:g}.yaml"
    )
    elsewhere = "another -o FILE"
    refuse_existing(out, args.overwrite, elsewhere)  # before the scan, which is costly
    cache = _beside(model) / CACHE_NAME
    weights = input_identity(model)  # the checkpoint MODEL means now, and its files
    scores = None if args.rescan else _cached_scores(cache, weights, args.model)
    if scores is None:
        scores = _scan(model, args.nproc_per_node)
        try:
            cached = {"source": str(model), "weights": weights, "scores": scores}
            cache.write_text(json.dumps(cached, indent=2))
        except OSError as e:
            print(f"(scores not cached: {cache} cannot be written, {e.strerror})")
    score = {name: s["score"] for name, s in scores.items()}
    modules = select(score, args.top_percent)
    text = selection_text(modules, args.top_percent, str(args.model), score)
    write_user_file(out, text, args.overwrite, elsewhere)
    print(f"{selected_share(modules, score, args.top_percent)} -> {out}")
    return 0


def _cached_scores(cache: Path, weights: dict, given: str) -> dict | None:
    """The scores cached in `cache` when they were computed from `weights` (the checkpoint
    and files MODEL means now: `input_identity`), else None (scan again, saying why): a run
    folder that trained on, or a file rewritten, has other weights than its scores."""
    from freetx.checkpoint.identity import same_input

    if not cache.is_file():
        return None
    try:
        cached = json.loads(cache.read_text())
    except (OSError, ValueError):
        cached = None
    if not isinstance(cached, dict) or not isinstance(cached.get("scores"), dict):
        print(f"{cache} is not a scores file freetx wrote: scanning again")
        return None
    before = cached.get("weights")
    if not isinstance(before, dict) or not same_input(before, weights):
        was = before.get("path") if isinstance(before, dict) else "weights it did not record"
        now = weights["path"] if weights["path"] != was else f"{was}, rewritten since"
        print(
            f"the scores in {cache} were computed from {was}; {given} now means {now}: "
            "scanning again"
        )
        return None
    print(
        f"reusing the scores in {cache}, computed from {weights['path']} (--rescan to "
        "compute them again)"
    )
    return cached["scores"]


def _scan(model: Path, nproc: int) -> dict:
    """Scores of every block matrix, computed here or on `nproc` processes."""
    if nproc <= 1:
        return scan_scores(str(model), rank=0, world_size=1)
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "scores.json"
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command = [*torchrun, f"--nproc-per-node={nproc}", __file__, str(model), str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0 or not out.is_file():
            raise RuntimeError(f"the distributed scan failed:\n{result.stderr[-3000:]}")
        return json.loads(out.read_text())


def scan_scores(
    model: str, rank: int, world_size: int, gather: Callable[[dict], list[dict]] | None = None
) -> dict:
    """This rank's share of the matrices (every world_size-th), scored; all of them when
    `gather` collects every rank's share (`HostGroup.all_gather_object`)."""
    from freetx.checkpoint import open_tensors, resolve_checkpoint
    from freetx.models.peft.spectrum import kind_of, score_matrix

    source = open_tensors(resolve_checkpoint(model))
    names = sorted(
        n for n in source.model_names() if len(source.infos["model." + n].shape) == 2 and kind_of(n)
    )
    mine = {}
    for name in names[rank::world_size]:
        mine[name.removesuffix(".weight")] = score_matrix(source.get("model." + name))
    if gather is None:
        return mine
    return {k: v for part in gather(mine) for k, v in part.items()}


if __name__ == "__main__":  # a torchrun worker of `_scan`
    from freetx.distributed import HostGroup, destroy_distributed, init_distributed

    runtime = init_distributed("cpu")
    host = HostGroup.new()
    scores = scan_scores(sys.argv[1], runtime.rank, runtime.world_size, host.all_gather_object)
    if runtime.is_rank_zero:
        Path(sys.argv[2]).write_text(json.dumps(scores))
    host.barrier()
    destroy_distributed()

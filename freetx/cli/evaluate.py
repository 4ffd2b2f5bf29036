"""`freetx eval CHECKPOINT [--tasks a,b] [--include-path DIR] [key=value ...]`: the short
form of `freetx run eval --config llm/hf_eval checkpoint=CHECKPOINT tasks=[a,b]
include_path=DIR key=value ...` (recipes/eval.py; docs/recipes/eval.md).
`--nproc-per-node N` runs it on N local processes, as `freetx run` does."""

from __future__ import annotations

import argparse

from freetx.cli.common import add_trust_option

CONFIG = "llm/hf_eval"

DESCRIPTION = f"""Evaluate CHECKPOINT (an HF folder, a run's output_dir, a DCP step, a
.safetensors file, a LoRA run) on lm-evaluation-harness tasks, perplexity over a dataset
(dataset.source=FILE) or rewards over generations: the eval recipe with its config
{CONFIG}, the key=value overrides applied. Writes <output_dir>/eval.json. A LoRA run
that saved its adapters only is read over the base it recorded; base=PATH reads that
base from where it is now, if it moved.

examples:
  freetx eval runs/sft --tasks my_task --include-path tasks/
  freetx eval /models/Llama-3.2-1B --tasks hellaswag,arc_easy limit=200 batch_size=16
  freetx eval --nproc-per-node 2 runs/sft dataset.source=eval.jsonl output_dir=runs/sft_eval
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="freetx eval",
        usage="freetx eval CHECKPOINT [--tasks a,b] [--include-path DIR] [key=value ...]",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="an HF folder, a run's output_dir, a DCP step, ...")
    p.add_argument("overrides", nargs="*", help=f"key=value overrides of {CONFIG}")
    p.add_argument("--tasks", help="lm-eval task names, comma-separated")
    p.add_argument("--include-path", metavar="DIR", help="a folder of local task YAMLs")
    p.add_argument("--nproc-per-node", metavar="N", help="local processes (torchrun's option)")
    add_trust_option(p)
    return p


def run_arguments(args: argparse.Namespace) -> list[str]:
    """The arguments of the `freetx run` this command is short for."""
    launch = ["--nproc-per-node", str(args.nproc_per_node)] if args.nproc_per_node else []
    launch += [f"--trust={name}" for name in args.trust]
    overrides = [f"checkpoint={args.checkpoint}"]
    if args.tasks:
        overrides.append(f"tasks=[{','.join(t.strip() for t in args.tasks.split(','))}]")
    if args.include_path:
        overrides.append(f"include_path={args.include_path}")
    return [*launch, "eval", "--config", CONFIG, *overrides, *args.overrides]


def main(args: argparse.Namespace) -> int:
    from freetx.cli import run

    return run.main(run_arguments(args))

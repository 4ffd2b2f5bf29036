"""The memory ladder of `llm/small` (52M parameters) on this machine: each rung added to the
one before, as a user turns them on (`freetx run full_finetune_fsdp2 --config llm/small
KEY=VALUE`), side by side in one run.

Rows (cumulative): baseline (no activation checkpointing, the loss's logits in one chunk,
samples padded, AdamW in fp32), + activation checkpointing (full), + chunked loss (8
chunks), + packing, + 8-bit AdamW (torchao), + optimizer in backward (no clipping), +
optimizer offload (instead of in backward: they do not combine), + all (offload and
activation offloading on top). Data: the built-in instruct tasks (documents of varied
length, so that packing has padding to remove), seq 256, 8 sequences a step, fp32, 2
processes under fsdp.

Columns: the peak memory of the fullest rank (its max RSS: on the CPU the "device" and the
"host" are one memory, so offloading moves nothing off it; the Python process itself holds
~0.45 GiB of it), `freetx estimate`'s device peak and host figure for the same config, the
median step time over steps 3..N, real (not padding) tokens per second, each with its
ratio to the baseline.

A second table says what the optimizer's state formats lose: llm/tiny (1.6M parameters)
trained for `--format-steps` steps on one process with AdamW's states in fp32, bf16
(`optimizer.state_dtype`), torchao's 8-bit, 4-bit and float8 AdamW: the validation loss
at the end, and its difference to fp32's.

    OMP_NUM_THREADS=1 python benchmarks/memory_ladder.py [--steps 5] [--format-steps 300]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import freetx, measured_run, table  # noqa: E402

GIB = 2**30
COMMON = [
    "dataset._component_=freetx.data.InstructDataset", "dataset.source=builtin",
    "dataset.seq_len=256", "dataset.num_builtin_examples=2000", "batch_size=8",
    "distributed.mixed_precision.param_dtype=float32", "model.dropout=0.0",
    "log_every_n_steps=1", "eval.max_batches=1", "checkpoint.save_final=false",
    "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]",
]  # fmt: skip
BASELINE = ["distributed.activation_checkpointing=none", "loss.num_chunks=1",
            "dataset.packed=false"]  # fmt: skip
RUNGS = [
    ("baseline", []),
    ("+ activation checkpointing", ["distributed.activation_checkpointing=full"]),
    ("+ chunked loss", ["loss.num_chunks=8"]),
    ("+ packing", ["dataset.packed=true"]),
    ("+ 8-bit AdamW", ["optimizer._component_=torchao.optim.AdamW8bit"]),
    ("+ optimizer in backward", ["optimizer.in_backward=true", "max_grad_norm=null"]),
    ("+ optimizer offload", ["optimizer.offload=cpu", "max_grad_norm=1.0"]),
    ("+ all", ["distributed.activation_offloading=true"]),
]


def cumulative() -> list[tuple[str, list[str]]]:
    """Each row's overrides: the baseline's, then every rung so far (a later value of a
    key replaces an earlier one; offload replaces in_backward)."""
    rows, keys = [], {}
    for name, overrides in RUNGS:
        for item in overrides:
            keys[item.split("=")[0]] = item
        if name == "+ optimizer offload":
            keys.pop("optimizer.in_backward")
        rows.append((name, with_baseline(keys)))
    return rows


def with_baseline(keys: dict[str, str]) -> list[str]:
    """The baseline's overrides with `keys`' values over them."""
    base = {item.split("=")[0]: item for item in BASELINE}
    return list({**base, **keys}.values())


def measure(overrides: list[str], steps: int, nproc: int, out: Path) -> dict:
    """One run of a rung: the fullest rank's max RSS and the median step time over steps 3..N."""
    return measured_run("llm/small", [*COMMON, *overrides], steps, nproc, out)


def estimated(overrides: list[str], nproc: int, out: Path) -> dict:
    """`freetx estimate`'s figures for the same config (fsdp): device peak and host bytes."""
    path = out / "estimate.json"
    freetx("estimate", "llm/small", *COMMON, *overrides, "--world-size", str(nproc),
           "--device", "cpu", "--json", str(path), "--overwrite")  # fmt: skip
    figures = json.loads(path.read_text())["analytic"]["fsdp"]
    return {"estimate": figures["peak"], "host": figures.get("host", 0.0)}


FORMATS = [
    ("AdamW fp32", ["optimizer._component_=torch.optim.AdamW"]),
    (
        "AdamW, bf16 states",
        ["optimizer._component_=torch.optim.AdamW", "optimizer.state_dtype=bfloat16"],
    ),  # fmt: skip
    ("AdamW8bit", ["optimizer._component_=torchao.optim.AdamW8bit"]),
    ("AdamW4bit", ["optimizer._component_=torchao.optim.AdamW4bit"]),
    ("AdamWFp8", ["optimizer._component_=torchao.optim.AdamWFp8"]),
]


def format_losses(steps: int, tmp: Path) -> list[list[str]]:
    """The final validation loss of llm/tiny with each optimizer state format."""
    rows, base = [], None
    for i, (name, overrides) in enumerate(FORMATS):
        out = tmp / f"format{i}"
        freetx("run", "full_finetune_fsdp2", "--config", "llm/tiny", f"output_dir={out}",
               f"max_steps={steps}", "checkpoint.save_final=false", "eval.max_batches=8",
               "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]", *overrides)  # fmt: skip
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        loss = [r["val/loss"] for r in records if "val/loss" in r][-1]
        base = loss if base is None else base
        rows.append([name, f"{loss:.4f}", f"{loss - base:+.4f}"])
        print(f"{name}: done", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--format-steps", type=int, default=300)
    args = parser.parse_args()
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(cumulative()):
            out = Path(tmp) / f"row{i}"
            figures = {**measure(overrides, args.steps, args.nproc, out),
                       **estimated(overrides, args.nproc, out)}  # fmt: skip
            base = base or figures
            rows.append([
                name,
                f"{figures['rss'] / GIB:.2f} ({figures['rss'] / base['rss']:.2f}x)",
                f"{figures['estimate'] / GIB:.2f} ({figures['estimate'] / base['estimate']:.2f}x)",
                f"{figures['host'] / GIB:.2f}",
                f"{figures['step_s']:.2f} ({figures['step_s'] / base['step_s']:.2f}x)",
                f"{figures['tokens_per_s']:,.0f} ({figures['tokens_per_s'] / base['tokens_per_s']:.2f}x)",
            ])  # fmt: skip
            print(f"{name}: done", file=sys.stderr, flush=True)
    print(f"llm/small (52M), fsdp on {args.nproc} CPU processes, fp32, seq 256, 8 sequences a "
          f"step, {args.steps} steps a row")  # fmt: skip
    print(table(rows, ["rung (cumulative)", "max RSS GiB/rank", "estimate GiB/rank",
                       "estimate host GiB", "step s", "real tokens/s"]))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        formats = format_losses(args.format_steps, Path(tmp))
    print(f"\nllm/tiny (1.6M), 1 process, {args.format_steps} steps: what a state format loses")
    print(table(formats, ["optimizer states", "val/loss", "vs fp32"]))


if __name__ == "__main__":
    main()

"""Quantization-aware training vs post-training quantization, on a tiny model freetx trained.

From one start (a run of `llm/instruct_tiny`, the tiny decoder instruction-tuned on the
built-in string tasks; --start), two fine-tunes of --steps steps with the same data order,
learning rate (constant) and seed, one process each, for each of --seeds data orders:

    plain  full_finetune_fsdp2, no qat:
    qat    the same with qat.scheme=SCHEME, qat.group_size=N (fake quantization throughout)

and the validation loss (the built-in tasks' validation split, every sample, loss on the
answers) of:

    (a) plain                 the unquantized model
    (b) plain, PTQ            (a) quantized by SCHEME (`freetx.models.qat.quantize_ptq`)
    (c) qat, converted        the QAT model's real quantized weights (the same quantize_ptq
                              of what it trained: `freetx checkpoint convert --quantize`)
    (d) qat, fake-quantized   the QAT model as it trained, before conversion

PTQ's loss: (b) - (a); QAT's: (c) - (a), of the means over the data orders (two runs that
differ in their data order alone lie about 0.01 apart here, as much as PTQ loses: one order
is not enough); recovered: 1 - QAT's / PTQ's.

    python benchmarks/qat.py --start RUN_OR_CHECKPOINT [--steps 100] [--scheme int4_weight]
        [--group-size 64] [--lr 1e-4] [--seeds 2] [--start-step 0]

int4_weight is converted in this process (the CPU's int4 kernel; only its export needs a
CUDA machine), and, that kernel being slow at this shape, its losses are the fake-quantized
model's, checked against the real one on 32 samples (`quantized_loss`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def fine_tune(output_dir: Path, start: str, steps: int, lr: float, qat: list[str]) -> float:
    """One fine-tune of `steps` steps from `start` (1 process); returns its seconds."""
    args = [
        sys.executable, "-m", "freetx", "run", "full_finetune_fsdp2", "--config",
        "llm/instruct_tiny", f"output_dir={output_dir}", f"checkpoint.initial_weights={start}",
        f"max_steps={steps}", f"optimizer.lr={lr}", "lr_schedule.warmup_steps=0",
        "lr_schedule.decay=constant", "eval.every_n_steps=0", "eval.max_batches=1",
        "checkpoint.every_n_steps=0", "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]",
        *qat,
    ]  # fmt: skip
    began = time.perf_counter()
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(result.stdout[-3000:] + result.stderr[-3000:])
    return time.perf_counter() - began


def validation_loss(model, samples: int | None = None) -> float:
    """Mean loss per answer token over the validation split of llm/instruct_tiny (its first
    `samples`; None: all)."""
    import torch

    from freetx.data import ByteTokenizer, InstructDataset, TokenBatch
    from freetx.objectives import CrossEntropyLoss

    data = InstructDataset(ByteTokenizer(), source="builtin", seq_len=64, val_fraction=0.05,
                           num_builtin_examples=20000, split="validation")  # fmt: skip
    count = len(data) if samples is None else min(samples, len(data))
    loss_fn, total, tokens = CrossEntropyLoss(), 0.0, 0
    with torch.no_grad():
        for first in range(0, count, 256):
            batch = TokenBatch.collate([data[i] for i in range(first, min(first + 256, count))])
            loss, _ = loss_fn(model, batch.input_ids, batch.labels)
            total += float(loss)
            tokens += int((batch.labels != -100).sum())
    return total / tokens


def quantized_loss(model, scheme: str, group_size: int, checks: list[float]) -> float:
    """The validation loss of `model` quantized by `scheme` (real weights, quantize_ptq).
    int4_weight's CPU kernel takes ~90 s per 256 sequences here, so its loss is taken from
    the fake-quantized model, which computes the same linears to 7e-7; `checks` gets the
    difference of the two losses on the first 32 samples."""
    import copy

    from freetx.models.qat import QATConfig, apply_qat, quantize_ptq

    real = quantize_ptq(copy.deepcopy(model), scheme, group_size)
    if scheme != "int4_weight":
        return validation_loss(real)
    fake = copy.deepcopy(model)
    apply_qat(fake, QATConfig(scheme=scheme, group_size=group_size))
    checks.append(abs(validation_loss(real, 32) - validation_loss(fake, 32)))
    return validation_loss(fake)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--start", required=True, help="a run folder or checkpoint of llm/instruct_tiny")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--scheme", default="int4_weight")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--start-step", type=int, default=0, help="qat.start_step of the QAT runs")
    p.add_argument("--seeds", type=int, default=2, help="data orders (run seeds) to average")
    p.add_argument("--out", help="keep the two runs here (default: a temporary folder)")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch

    from freetx.checkpoint import load_model
    from freetx.models.qat import QATConfig, apply_qat

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    out = Path(args.out or tempfile.mkdtemp(prefix="freetx_qat_bench_"))
    qat = [f"qat.scheme={args.scheme}", f"qat.group_size={args.group_size}",
           f"qat.start_step={args.start_step}"]  # fmt: skip
    scheme, size, cpu, checks = args.scheme, args.group_size, torch.device("cpu"), []
    start = load_model(args.start, cpu)
    rows = [["start", f"{validation_loss(start):.4f}",
             f"{quantized_loss(start, scheme, size, checks):.4f}", "-", "-"]]  # fmt: skip
    results, seconds = [], {"plain": 0.0, "qat": 0.0}
    for seed in range(args.seeds):  # the data order: the runs' spread
        runs = {}
        for kind, extra in (("plain", []), ("qat", qat)):
            runs[kind] = out / f"{kind}_seed{seed}"
            seconds[kind] += fine_tune(
                runs[kind], args.start, args.steps, args.lr, [f"seed={seed}", *extra]
            )
        plain, trained = load_model(runs["plain"], cpu), load_model(runs["qat"], cpu)
        fake = copy.deepcopy(trained)
        apply_qat(fake, QATConfig(scheme=scheme, group_size=size))
        results.append({
            "(a) plain": validation_loss(plain),
            "(b) plain, PTQ": quantized_loss(plain, scheme, size, checks),
            "(c) qat, converted": quantized_loss(trained, scheme, size, checks),
            "(d) qat, fake-quantized": validation_loss(fake),
        })  # fmt: skip
        rows.append([f"seed {seed}", *(f"{v:.4f}" for v in results[-1].values())])
    mean = {key: sum(r[key] for r in results) / len(results) for key in results[0]}
    rows.append(["mean", *(f"{v:.4f}" for v in mean.values())])
    ptq = mean["(b) plain, PTQ"] - mean["(a) plain"]
    qat_loss = mean["(c) qat, converted"] - mean["(a) plain"]
    recovered = 1 - qat_loss / ptq if ptq > 0 else float("nan")
    print(
        f"{scheme}, groups of {size}; {args.steps} steps at lr {args.lr} from {args.start}, "
        f"qat.start_step {args.start_step}, {args.seeds} data orders; fine-tuning {seconds['plain']:.0f} s plain, "
        f"{seconds['qat']:.0f} s qat"
    )
    if checks:
        print(f"int4_weight: real vs fake-quantized loss on 32 samples, at most {max(checks):.1e}")
    print(table(rows, ["model", *mean]))
    print(
        f"mean: PTQ loses {ptq:+.4f}, QAT {qat_loss:+.4f} (converted vs plain): QAT recovers "
        f"{recovered:.0%} of PTQ's loss"
    )
    print(json.dumps({"results": results, "ptq": ptq, "qat": qat_loss, "recovered": recovered}))


if __name__ == "__main__":
    main()

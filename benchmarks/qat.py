"""Quantization-aware training vs post-training quantization, on a tiny model freetx trained.

From one start (a run of `llm/instruct_tiny`, the tiny decoder instruction-tuned on the
built-in string tasks; --start), two fine-tunes of --steps steps with the same data order,
learning rate and seed, one process each:

    plain  full_finetune_fsdp2, no qat:
    qat    the same with qat.scheme=SCHEME, qat.group_size=N (fake quantization throughout)

and the validation loss (the built-in tasks' validation split, every sample, loss on the
answers) of:

    (a) plain                 the unquantized model
    (b) plain, PTQ            (a) quantized by SCHEME (`freetx.models.qat.quantize_ptq`)
    (c) qat, converted        the QAT model's real quantized weights (the same quantize_ptq
                              of what it trained: `freetx checkpoint convert --quantize`)
    (d) qat, fake-quantized   the QAT model as it trained, before conversion

PTQ's loss: (b) - (a); QAT's: (c) - (a); recovered: 1 - QAT's / PTQ's.

    python benchmarks/qat.py --start RUN_OR_CHECKPOINT [--steps 100] [--scheme int4_weight]
        [--group-size 64] [--lr 3e-4]

int4_weight is converted in this process (the CPU's int4 kernel); only its export needs a
CUDA machine.
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


def validation_loss(model) -> float:
    """Mean loss per answer token over the whole validation split of llm/instruct_tiny."""
    import torch

    from freetx.data import ByteTokenizer, InstructDataset, TokenBatch
    from freetx.training import CrossEntropyLoss

    data = InstructDataset(ByteTokenizer(), source="builtin", seq_len=64, val_fraction=0.05,
                           num_builtin_examples=20000, split="validation")  # fmt: skip
    loss_fn, total, tokens = CrossEntropyLoss(), 0.0, 0
    with torch.no_grad():
        for first in range(0, len(data), 256):
            rows = range(first, min(first + 256, len(data)))
            batch = TokenBatch.collate([data[i] for i in rows])
            loss, _ = loss_fn(model, batch.input_ids, batch.labels)
            total += float(loss)
            tokens += int((batch.labels != -100).sum())
    return total / tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--start", required=True, help="a run folder or checkpoint of llm/instruct_tiny")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--scheme", default="int4_weight")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--out", help="keep the two runs here (default: a temporary folder)")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch

    from freetx.checkpoint import load_model
    from freetx.models.qat import QATConfig, apply_qat, quantize_ptq

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    out = Path(args.out or tempfile.mkdtemp(prefix="freetx_qat_bench_"))
    qat = [f"qat.scheme={args.scheme}", f"qat.group_size={args.group_size}"]
    seconds = {
        "plain": fine_tune(out / "plain", args.start, args.steps, args.lr, []),
        "qat": fine_tune(out / "qat", args.start, args.steps, args.lr, qat),
    }
    cpu = torch.device("cpu")
    start = load_model(args.start, cpu)
    plain, trained = load_model(out / "plain", cpu), load_model(out / "qat", cpu)
    fake = copy.deepcopy(trained)
    apply_qat(fake, QATConfig(scheme=args.scheme, group_size=args.group_size))
    losses = {
        "start": validation_loss(start),
        "start, PTQ": validation_loss(quantize_ptq(start, args.scheme, args.group_size)),
        "(a) plain": validation_loss(plain),
        "(b) plain, PTQ": validation_loss(quantize_ptq(plain, args.scheme, args.group_size)),
        "(c) qat, converted": validation_loss(quantize_ptq(trained, args.scheme, args.group_size)),
        "(d) qat, fake-quantized": validation_loss(fake),
    }
    unquantized = losses["(a) plain"]
    ptq = losses["(b) plain, PTQ"] - unquantized
    qat_loss = losses["(c) qat, converted"] - unquantized
    rows = [[name, f"{value:.4f}", f"{value - unquantized:+.4f}"] for name, value in losses.items()]
    print(
        f"{args.scheme}, groups of {args.group_size}; {args.steps} steps at lr {args.lr} from "
        f"{args.start}; plain {seconds['plain']:.0f} s, qat {seconds['qat']:.0f} s"
    )
    print(table(rows, ["model", "val loss", "vs (a)"]))
    recovered = 1 - qat_loss / ptq if ptq > 0 else float("nan")
    print(f"PTQ loses {ptq:+.4f}, QAT {qat_loss:+.4f}: QAT recovers {recovered:.0%} of PTQ's loss")
    print(json.dumps({"losses": losses, "ptq": ptq, "qat": qat_loss, "recovered": recovered}))


if __name__ == "__main__":
    main()

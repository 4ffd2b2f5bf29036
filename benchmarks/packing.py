"""Packed vs padded instruction tuning on CPU: loss tokens per second, and the validation
loss after the same number of steps at about the same loss tokens per step.

A generated instruction set with realistic lengths (byte tokens: log-normal, median ~300,
cut at 4096; the prompt 20-60% of each example, the response the rest, every response
token a loss token), seq_len 2048, the tiny decoder (4 layers, hidden 192), 2 processes
(`freetx run --nproc-per-node 2 full_finetune_fsdp2`, FSDP2 over gloo). The padded run
serves one example per sequence (`dataset.packed=false`); the packed run several
(`dataset.packed=true`), with a batch that many times smaller, so that both take about
the same loss tokens per step. Loss tokens per step are the split's mean per sequence
times the batch; seconds per step are the run's logged `step_time_s` over the steps after
the first `--steps // 2` (the first window holds the warm-up).

    OMP_NUM_THREADS=1 python benchmarks/packing.py                 # ~3 minutes on 2 cores
    OMP_NUM_THREADS=1 python benchmarks/packing.py --steps 20 --examples 4000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, table  # noqa: E402

SEQ_LEN = 2048
WORDS = ("the of and to in is was for on that with as by at from this be are it an or "
         "which model data train token sample loss batch step value layer time result").split()  # fmt: skip


def generate(path: Path, count: int, seed: int = 0) -> None:
    """`count` prompt/response pairs whose byte lengths are log-normal (median 300,
    sigma 0.9) cut to [24, 4096]."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.exp(rng.normal(np.log(300), 0.9, count)), 24, 4096).astype(int)
    with open(path, "w") as f:
        for n in lengths:
            words = " ".join(rng.choice(WORDS, size=n // 3))[: n - 2]  # BOS and EOS: 2 tokens
            cut = int(len(words) * rng.uniform(0.2, 0.6))
            f.write(json.dumps({"prompt": words[:cut], "response": words[cut:]}) + "\n")


def split_stats(source: Path, packed: bool) -> dict[str, float]:
    """The train split's sequences, mean loss tokens and real tokens per sequence."""
    from freetx.data import ByteTokenizer, InstructDataset
    from freetx.data.sampling import IGNORE_INDEX

    data = InstructDataset(ByteTokenizer(), str(source), seq_len=SEQ_LEN, packed=packed)
    rows = [data[i] for i in range(len(data))]
    loss = sum(int((r["labels"] != IGNORE_INDEX).sum()) for r in rows)
    if packed:
        real = sum(int(r["real_tokens"]) for r in rows)
    else:  # the example's tokens but its last (only a label), as a pack counts them
        real = sum(min(int(n), SEQ_LEN + 1) - 1 for n in data.rows.lengths)
    return {"sequences": len(rows), "loss": loss / len(rows), "real": real / len(rows)}


def run(out: Path, source: Path, packed: bool, batch: int, steps: int) -> dict[str, float]:
    """One 2-process run; its last logged seconds per step and its final val/loss."""
    overrides = [
        f"output_dir={out}", f"dataset.source={source}", f"dataset.seq_len={SEQ_LEN}",
        f"dataset.packed={str(packed).lower()}", "dataset.val_fraction=0.02",
        f"model.max_seq_len={SEQ_LEN}", f"batch_size={batch}", f"max_steps={steps}",
        f"log_every_n_steps={steps // 2}", "lr_schedule.warmup_steps=2",
        "eval.every_n_steps=0", "eval.batch_size=8", "eval.max_batches=null",
        "checkpoint.every_n_steps=0", "checkpoint.save_final=false", "resume=never",
        "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "freetx", "run", "--nproc-per-node", "2",
           "full_finetune_fsdp2", "--config", "llm/instruct_tiny", *overrides]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(result.stdout[-2000:] + result.stderr[-4000:])
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    step_time = [r["step_time_s"] for r in records if "step_time_s" in r][-1]
    val = [r["val/loss"] for r in records if "val/loss" in r][-1]
    return {"step_time": step_time, "val_loss": val}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=10, help="the padded run's global batch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "pairs.jsonl"
        generate(source, args.examples)
        padded, packed = split_stats(source, False), split_stats(source, True)
        per_pack = packed["loss"] / padded["loss"]
        packed_batch = max(2, 2 * round(args.batch / per_pack / 2))  # 2 ranks: even
        rows, results = [], {}
        for name, stats, batch, is_packed in (
            ("padded", padded, args.batch, False), ("packed", packed, packed_batch, True),
        ):  # fmt: skip
            timing = run(Path(tmp) / name, source, is_packed, batch, args.steps)
            loss_per_step = stats["loss"] * batch
            results[name] = {**timing, "loss_tokens_per_s": loss_per_step / timing["step_time"]}
            rows.append([
                name, stats["sequences"], batch, f"{1 - stats['real'] / SEQ_LEN:.1%}",
                f"{loss_per_step:.0f}", f"{args.steps * loss_per_step:.0f}",
                f"{timing['step_time']:.2f}", f"{results[name]['loss_tokens_per_s']:.0f}",
                f"{timing['val_loss']:.4f}",
            ])  # fmt: skip
    print(f"{args.examples} generated pairs, seq_len {SEQ_LEN}, tiny decoder, 2 processes, "
          f"{args.steps} steps; {per_pack:.2f} examples' loss tokens per pack")  # fmt: skip
    print(table(rows, ["run", "train seqs", "batch", "padding", "loss tok/step",
                       "loss tok seen", "s/step", "loss tok/s", "val/loss"]))  # fmt: skip
    speedup = results["packed"]["loss_tokens_per_s"] / results["padded"]["loss_tokens_per_s"]
    gap = results["packed"]["val_loss"] - results["padded"]["val_loss"]
    print(f"packed / padded: loss tokens per second x{speedup:.2f}; val/loss {gap:+.4f}")


if __name__ == "__main__":
    main()

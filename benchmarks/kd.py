"""Knowledge distillation (`kd_fsdp2`, `llm/kd_tiny`): a live teacher vs a precomputed
one's top-k vs the labels alone, measured side by side in one run, one section each.

- step: 40 steps of the live and the precomputed (top-64) teacher (2 processes, fsdp),
  in turns, `--repeats` times: the median step time over steps 6-40 (what the run logs
  as step_time_s), its ratio to the live teacher's, each rank's peak resident memory,
  and for the precomputed teacher the time of its one pass over the data and the size
  of the table it keeps (what the run says).
- curves: the config's 300 steps of each mode (live, top-64, top-8, and the labels
  alone: kd_weight 0): val/ce (the student's cross-entropy of the validation labels)
  every 50 steps.

The teacher is a run of `llm/instruct_tiny` (`--teacher`, default
runs/llm_instruct_tiny: `freetx run --nproc-per-node 2 full_finetune_fsdp2 --config
llm/instruct_tiny max_steps=1000`).

    OMP_NUM_THREADS=1 python benchmarks/kd.py --teacher runs/llm_instruct_tiny   # ~8 min
    python benchmarks/kd.py --section step
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, table  # noqa: E402

MODES = {
    "live teacher": [],
    "precomputed top-64": ["teacher.precompute=top_k", "teacher.top_k=64"],
    "precomputed top-8": ["teacher.precompute=top_k", "teacher.top_k=8"],
    "labels alone": ["loss.kd_weight=0", "loss.ce_weight=1"],
}


def run(out: Path, teacher: str, overrides: list[str]) -> tuple[list[dict], str]:
    command = [
        sys.executable, "-m", "freetx", "run", "--nproc-per-node", "2", "kd_fsdp2",
        "--config", "llm/kd_tiny", f"output_dir={out}", f"teacher.weights={teacher}",
        "checkpoint.every_n_steps=0", "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]",
        *overrides,
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stdout[-3000:] + done.stderr[-3000:])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, done.stdout


def step_times(teacher: str, repeats: int) -> None:
    """Section: step time and memory of each mode, 40 steps each, in turns."""
    modes = ["live teacher", "precomputed top-64"]
    seconds, memory, notes = {m: [] for m in modes}, {m: 0.0 for m in modes}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for mode in modes:
                out = Path(tmp) / f"{repeat}_{modes.index(mode)}"
                rows, console = run(out, teacher, [*MODES[mode], "max_steps=40",
                                    "log_every_n_steps=1", "eval.every_n_steps=0",
                                    "eval.max_batches=1"])  # fmt: skip
                steps = [r for r in rows if "step_time_s" in r and r["step"] > 5]
                seconds[mode].append(statistics.median(r["step_time_s"] for r in steps))
                memory[mode] = max(memory[mode], *(r["memory/max_rss_gib"] for r in steps))
                made = re.search(r"train samples computed in ([\d.]+) s, kept in .*\(([\d.]+) MiB",
                                 console)  # fmt: skip
                if made:
                    notes[mode] = f"one pass {made[1]} s, table {made[2]} MiB"
    live = statistics.median(seconds["live teacher"])
    print("llm/kd_tiny, 2 processes (fsdp), 32 sequences of 64 tokens per step, "
          f"median of {repeats} x steps 6-40")  # fmt: skip
    print(table([[m, f"{statistics.median(seconds[m]):.4f}",
                  f"{statistics.median(seconds[m]) / live:.2f}", f"{memory[m]:.2f}",
                  notes.get(m, "")] for m in modes],
                ["mode", "step s", "vs live", "peak RSS GiB per rank", "precompute"]))  # fmt: skip


def curves(teacher: str) -> None:
    """Section: val/ce every 50 steps over the config's 300 steps, each mode."""
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (mode, overrides) in enumerate(MODES.items()):
            rows, _ = run(Path(tmp) / str(i), teacher, overrides)
            val = [r["val/ce"] for r in rows if "val/ce" in r]
            rows_out.append([mode, *(f"{v:.3f}" for v in val)])
    steps = [str(50 * (i + 1)) for i in range(len(rows_out[0]) - 1)]
    print("val/ce (the student's cross-entropy of the validation labels) at step")
    print(table(rows_out, ["mode", *steps]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", default="runs/llm_instruct_tiny")
    p.add_argument("--section", choices=("step", "curves"), default=None)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    if args.section in (None, "step"):
        step_times(args.teacher, args.repeats)
    if args.section in (None, "curves"):
        curves(args.teacher)


if __name__ == "__main__":
    main()

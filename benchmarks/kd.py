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
- on_policy: the same student and teacher, off-policy (llm/kd_tiny's loss; forward KL or
  reverse KL alone on the data's answers) and on-policy (llm/on_policy_kd_tiny: forward or
  reverse KL on the student's own samples; reverse KL with lmbda 0.5), from random weights
  for 300 steps (lr 3e-3), and from llm/kd_tiny's student at step 150 for 150 more (lr
  3e-3 and 1e-3): the teacher's
  measure of each student, val/student_samples/reverse_kl (its reverse KL per token on
  the student's samples of the validation prompts, the same draws for every mode) every
  50 steps, the loss tokens each trained on, and the final student's greedy answers to
  300 held-out built-in prompts (benchmarks/builtin_greedy.py), the teacher's too.

The teacher is a run of `llm/instruct_tiny` (`--teacher`, default
runs/llm_instruct_tiny: `freetx run --nproc-per-node 2 full_finetune_fsdp2 --config
llm/instruct_tiny max_steps=1000`).

    OMP_NUM_THREADS=1 python benchmarks/kd.py --teacher runs/llm_instruct_tiny   # ~25 min
    python benchmarks/kd.py --section step
    python benchmarks/kd.py --section on_policy   # ~16 min
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

from benchmarks.builtin_greedy import greedy_counts  # noqa: E402
from benchmarks.common import REPO, table  # noqa: E402

MODES = {
    "live teacher": [],
    "precomputed top-64": ["teacher.precompute=top_k", "teacher.top_k=64"],
    "precomputed top-8": ["teacher.precompute=top_k", "teacher.top_k=8"],
    "labels alone": ["loss.kd_weight=0", "loss.ce_weight=1"],
}


# the same student and steps, off-policy and on: (config, overrides)
ON_POLICY_MODES = {
    "off-policy: 0.5 ce + 0.5 forward KL (kd_tiny)": ("llm/kd_tiny", []),
    "off-policy: forward KL on the data's answers": (
        "llm/on_policy_kd_tiny", ["on_policy.lmbda=0", "loss.divergence=forward_kl"]),
    "on-policy: forward KL on its samples": (
        "llm/on_policy_kd_tiny", ["loss.divergence=forward_kl"]),
    "off-policy: reverse KL on the data's answers": (
        "llm/on_policy_kd_tiny", ["on_policy.lmbda=0"]),
    "on-policy: reverse KL on its samples": ("llm/on_policy_kd_tiny", []),
    "on-policy: reverse KL, lmbda 0.5": ("llm/on_policy_kd_tiny", ["on_policy.lmbda=0.5"]),
}  # fmt: skip
SAMPLES = "val/student_samples/reverse_kl"


def run(out: Path, teacher: str, overrides: list[str], config: str = "llm/kd_tiny"):
    command = [
        sys.executable, "-m", "freetx", "run", "--nproc-per-node", "2", "kd_fsdp2",
        "--config", config, f"output_dir={out}", f"teacher.weights={teacher}",
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


def on_policy(teacher: str) -> None:
    """Section: off-policy vs on-policy distillation, from random weights (300 steps) and
    from a student off-policy distilled for 150 steps (150 more): the teacher's reverse KL
    on the student's samples every 50 steps, the final student's greedy answers and the
    loss tokens it trained on."""
    right = sum(c[0] for c in greedy_counts(teacher).values())
    print(f"the teacher ({teacher}): {right}/300 greedy answers right")
    with tempfile.TemporaryDirectory() as tmp:
        compare(teacher, Path(tmp) / "scratch", 300, None, 3e-3,
                "from random weights, 300 steps, lr 3e-3")  # fmt: skip
        warm = Path(tmp) / "warm"
        run(warm, teacher, ["max_steps=150", "checkpoint.every_n_steps=150"])
        for lr in (3e-3, 1e-3):  # kd_tiny's, and on_policy_kd_tiny's
            compare(teacher, Path(tmp) / f"more_{lr}", 150, warm, lr,
                    f"from llm/kd_tiny's student at step 150, 150 steps more, lr {lr:g}")  # fmt: skip


def compare(teacher: str, tmp: Path, steps: int, start: Path | None, lr: float, title: str) -> None:
    """Each of ON_POLICY_MODES for `steps` steps from `start` (None: random weights) at
    learning rate `lr`."""
    curves_out, answers = [], []
    for i, (mode, (config, overrides)) in enumerate(ON_POLICY_MODES.items()):
        out = tmp / str(i)
        common = ["on_policy.validate=true", "on_policy.max_completion_length=24",
                  f"max_steps={steps}", f"checkpoint.every_n_steps={steps}",
                  "log_every_n_steps=1"]  # fmt: skip
        common += [f"checkpoint.initial_weights={start or 'null'}", f"optimizer.lr={lr}"]
        rows, _ = run(out, teacher, [*common, *overrides], config)
        val = [r[SAMPLES] for r in rows if SAMPLES in r]
        trained = sum(r["loss_tokens_per_s"] * r["step_time_s"] for r in rows if "loss" in r)
        curves_out.append([mode, *(f"{v:.3f}" for v in val)])
        right = sum(c[0] for c in greedy_counts(str(out)).values())
        answers.append([mode, f"{val[-1]:.3f}", f"{right}/300", f"{trained:,.0f}"])
    print(
        f"{title}: {SAMPLES} (the teacher's reverse KL per token on the student's samples "
        "of the validation prompts, the same draws for every mode; lower is better) at step"
    )
    print(table(curves_out, ["mode", *(str(50 * (i + 1)) for i in range(len(val)))]))
    print(f"{title}: the final student, 32 rows per step")
    print(table(answers, ["mode", SAMPLES, "greedy answers right", "loss tokens trained"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", default="runs/llm_instruct_tiny")
    p.add_argument("--section", choices=("step", "curves", "on_policy"), default=None)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    if args.section in (None, "step"):
        step_times(args.teacher, args.repeats)
    if args.section in (None, "curves"):
        curves(args.teacher)
    if args.section in (None, "on_policy"):
        on_policy(args.teacher)


if __name__ == "__main__":
    main()

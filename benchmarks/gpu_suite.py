"""Every recipe's speed and memory on the device this machine has: a fixed list of short
measured workloads, each a `freetx run` of a shipped config on random weights of a public
model's shape (its config.json: benchmarks/shapes.py) and the built-in data (no downloads),
written as a table beside `freetx estimate`'s figure for the same config.

    python benchmarks/gpu_suite.py --out gpu_results            # all (--budget-s 480)
    python benchmarks/gpu_suite.py --out gpu_results --quick    # one per recipe
    python benchmarks/gpu_suite.py --out gpu_results --only lora_llama8b
    python benchmarks/gpu_suite.py --out /tmp/s --device cpu --tiny   # the plumbing, on a CPU

(How long each takes on a GPU is not measured yet: the workloads are sized for 30-60 s each
on one H200, the quick ones first, so that a suite cut by --budget-s has one per recipe.)

Each workload runs `steps` optimizer steps on one process (one GPU: no sharding, bf16
autocast over float32 weights); its figures are the medians of the steps after the first
`warmup` (compilation, the allocator's first growth): `tokens_per_s_per_device` (real
tokens: packing leaves no padding), MFU as the run logs it (training FLOPs per token
6 N + 12 L H d T: N the non-embedding parameters, active ones for an MoE, L layers, H heads
of width d, T one sequence's length; a frozen weight, a LoRA run's base, at 4 N instead
of 6 N; over the device's dense bf16 peak, `freetx.training.meters.PEAK_BF16_FLOPS`), and
the peak memory the CUDA allocator reserved. The estimate is `freetx estimate CONFIG ...
--world-size 1 --device h200` (cpu with --device cpu). DPO's row says its step time
against the SFT workload of the same model and positions per step (`vs`); GRPO's, the
share of its step spent generating and the generation engine's tokens per second.

`--tiny`: the same workloads at a tiny size of each shape's family (2 layers, width 64,
sequences of 128), 2 steps each, compile and float8 left out: what `pytest` runs on a CPU so
that the suite is known to work before a GPU is lent. A workload that fails records its
error and the suite goes on; results.json and results.md are rewritten after each one, so
a suite stopped by its time limit (`--budget-s`) keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import medians, step_records  # noqa: E402
from benchmarks.shapes import HF_SHAPES, tiny_shape, write_shape  # noqa: E402

GIB = 2**30
# what every workload sets: random weights of the shape, the byte tokenizer (the built-in
# data's), a step logged each step to metrics.jsonl, no checkpoint, one validation batch
COMMON = [
    "checkpoint.initial_weights=null", "tokenizer={_component_: freetx.data.ByteTokenizer}",
    "log_every_n_steps=1", "checkpoint.every_n_steps=0", "checkpoint.save_final=false",
    "eval.every_n_steps=0", "eval.max_batches=1", "resume=never", "num_workers=2",
    "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]",
]  # fmt: skip
GPU_ONLY = ("distributed.compile=", "distributed.float8=")  # left out by --tiny
COMPILE = "distributed.compile=true"
NO_AC = "distributed.activation_checkpointing=none"
FLOAT8 = "distributed.float8=tensorwise"


def packed_text(seq_len: int) -> str:
    """The built-in corpus as one token stream cut into sequences of seq_len, each document
    attending to itself only (as packed samples do): no padding."""
    return (
        "dataset={_component_: freetx.data.PackedTextDataset, source: builtin, "
        f"seq_len: {seq_len}, packed: true, val_fraction: 0.05}}"
    )


def packed_pairs(seq_len: int) -> str:
    """The built-in preference pairs packed into rows of seq_len (chosen and rejected rows)."""
    return (
        "dataset={_component_: freetx.data.PreferenceDataset, source: builtin, "
        f"seq_len: {seq_len}, packed: true, val_fraction: 0.05, num_builtin_examples: 20000}}"
    )


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    recipe: str
    config: str  # the shipped config it starts from
    shape: str  # a key of HF_SHAPES
    about: str  # what the config's keys do not say, for the table
    overrides: tuple[str, ...]
    tiny: tuple[str, ...]  # what --tiny sets on top (sizes), after `overrides`
    steps: int = 6
    warmup: int = 2  # the first steps left out of the medians
    quick: bool = False  # in --quick: one per recipe
    shape_fields: tuple[tuple[str, object], ...] = ()  # changed in the shape (fewer layers)
    vs: str | None = None  # the SFT workload of the same model and positions per step


SFT_TINY = ("dataset.seq_len=128", "model.max_seq_len=128", "batch_size=4")
DPO_TINY = ("dataset.seq_len=128", "model.max_seq_len=128", "batch_size=2")
LORA = "lora_finetune_fsdp2"
FULL = "full_finetune_fsdp2"
# the quick ones first (one per recipe, by what a reader looks for first: SFT of a small
# model, LoRA of an 8B, preference, RL, an MoE, the memory ladder), then the others. The
# final evaluation's batch is the training micro-batch's, so compile does not recompile.
WORKLOADS = [
    Workload("sft_llama1b", FULL, "llm/llama3_2_1b_full", "Llama-3.2-1B", "8 x 4096",
             (packed_text(4096), "batch_size=8", "eval.batch_size=8", NO_AC, COMPILE),
             SFT_TINY, quick=True),
    Workload("lora_llama8b", LORA, "llm/llama3_1_8b_lora", "Llama-3.1-8B", "2 x 4096",
             (packed_text(4096), "batch_size=2", "gradient_accumulation_steps=1",
              "eval.batch_size=2", NO_AC, "peft.dropout=0.0"), SFT_TINY, quick=True),
    # DPO: packs of pairs, a chosen row and a rejected row of 4096 each: one pack's
    # positions are the SFT workload's two sequences
    Workload("dpo_lora_llama8b", "dpo_fsdp2", "llm/llama3_1_8b_dpo_lora", "Llama-3.1-8B",
             "1 pack of pairs (2 x 4096), reference = adapters off",
             (packed_pairs(4096), "model.max_seq_len=4096", "batch_size=1",
              "gradient_accumulation_steps=1", "eval.batch_size=1", NO_AC), DPO_TINY,
             quick=True, vs="lora_llama8b"),
    # GRPO end to end: 64 prompts x 8 completions of up to 512 tokens (random weights stop
    # at the length, so every completion is 512), the policy generating with its own weights
    Workload("grpo_llama1b", "grpo_fsdp2", "llm/qwen3_8b_grpo", "Llama-3.2-1B",
             "64 prompts x 8 completions of 512, KL to a frozen reference",
             ("dataset={_component_: freetx.data.PromptDataset, source: builtin, "
              "max_prompt_len: 128, val_fraction: 0.05, num_builtin_examples: 4000}",
              "rewards=[{_component_: freetx.objectives.ExactMatch, answer_field: answer}]",
              "batch_size=64", "gradient_accumulation_steps=8", "model.max_seq_len=640",
              "generation.num_generations=8", "generation.max_completion_length=512",
              "eval.batch_size=8", "samples.every_n_steps=0"),
             ("batch_size=4", "gradient_accumulation_steps=2", "model.max_seq_len=40",
              "dataset.max_prompt_len=32", "generation.num_generations=2",
              "generation.max_completion_length=8", "eval.batch_size=2"),
             steps=3, warmup=1, quick=True),
    # a Qwen3-30B-A3B-shaped stack of 4 blocks (128 experts, 8 active): one GPU holds it
    Workload("moe_qwen3_30b_a3b_4l", FULL, "llm/qwen3_30b_a3b_full", "Qwen3-30B-A3B",
             "4 x 4096, 4 of 48 blocks, experts as one grouped matmul",
             (packed_text(4096), "batch_size=4", "gradient_accumulation_steps=1",
              "eval.batch_size=4", "distributed.ep=1"), SFT_TINY, quick=True,
             shape_fields=(("num_hidden_layers", 4),)),
    # the memory ladder on the 8B shape, rung by rung of llm/llama3_1_8b_full_1gpu (full
    # AC, 8 chunks of logits, 8-bit AdamW), each against the estimate
    Workload("ladder_8b_in_backward", FULL, "llm/llama3_1_8b_full_1gpu", "Llama-3.1-8B",
             "2 x 4096, 8-bit AdamW stepped in backward, logits in 8 chunks",
             (packed_text(4096), "batch_size=2", "eval.batch_size=2"), SFT_TINY, steps=4,
             warmup=1, quick=True),
    Workload("sft_llama1b_float8", FULL, "llm/llama3_2_1b_full", "Llama-3.2-1B", "8 x 4096",
             (packed_text(4096), "batch_size=8", "eval.batch_size=8", NO_AC, COMPILE, FLOAT8),
             SFT_TINY),
    Workload("sft_qwen3_0_6b", FULL, "llm/llama3_2_1b_full", "Qwen3-0.6B", "8 x 4096",
             (packed_text(4096), "batch_size=8", "eval.batch_size=8", NO_AC, COMPILE),
             SFT_TINY),
    Workload("sft_qwen3_0_6b_float8", FULL, "llm/llama3_2_1b_full", "Qwen3-0.6B", "8 x 4096",
             (packed_text(4096), "batch_size=8", "eval.batch_size=8", NO_AC, COMPILE, FLOAT8),
             SFT_TINY),
    Workload("lora_llama8b_ac", LORA, "llm/llama3_1_8b_lora", "Llama-3.1-8B", "2 x 4096",
             (packed_text(4096), "batch_size=2", "gradient_accumulation_steps=1",
              "eval.batch_size=2", "peft.dropout=0.0"), SFT_TINY),
    Workload("qlora_llama8b", LORA, "llm/llama3_1_8b_qlora", "Llama-3.1-8B", "2 x 4096",
             (packed_text(4096), "batch_size=2", "gradient_accumulation_steps=1",
              "eval.batch_size=2", "peft.dropout=0.0"), SFT_TINY),
    Workload("dpo_full_llama1b", "dpo_fsdp2", "llm/qwen3_8b_dpo", "Llama-3.2-1B",
             "4 packs of pairs (8 x 4096), frozen reference copy",
             (packed_pairs(4096), "model.max_seq_len=4096", "batch_size=4",
              "gradient_accumulation_steps=1", "eval.batch_size=4", NO_AC, COMPILE),
             DPO_TINY, vs="sft_llama1b"),
    Workload("ladder_8b_adamw8bit", FULL, "llm/llama3_1_8b_full_1gpu", "Llama-3.1-8B",
             "2 x 4096, 8-bit AdamW, logits in 8 chunks",
             (packed_text(4096), "batch_size=2", "eval.batch_size=2",
              "optimizer.in_backward=false", "max_grad_norm=1.0"), SFT_TINY, steps=4, warmup=1),
    Workload("ladder_8b_offload", FULL, "llm/llama3_1_8b_full_1gpu", "Llama-3.1-8B",
             "2 x 4096, 8-bit AdamW offloaded to the CPU, logits in 8 chunks",
             (packed_text(4096), "batch_size=2", "eval.batch_size=2",
              "optimizer.in_backward=false", "optimizer.offload=cpu", "max_grad_norm=1.0"),
             SFT_TINY, steps=3, warmup=1),
]  # fmt: skip
BY_NAME = {w.name: w for w in WORKLOADS}


def quick_list(workloads: list[Workload]) -> list[Workload]:
    """Those of `workloads` marked quick: one per recipe."""
    return [w for w in workloads if w.quick]


def model_folder(workload: Workload, out: Path, small: bool) -> Path:
    shape = dict(HF_SHAPES[workload.shape], **dict(workload.shape_fields))
    shape = tiny_shape(shape) if small else shape
    suffix = "".join(f"_{k}{v}" for k, v in workload.shape_fields)
    return write_shape(
        shape, out / "shapes" / f"{workload.shape}{suffix}{'_tiny' if small else ''}"
    )


def arguments(workload: Workload, folder: Path, output_dir: Path, device: str, small: bool):
    """The `freetx run` arguments (after `run`) of a workload."""
    overrides = [f"model_dir={folder}", f"output_dir={output_dir}", f"device={device}",
                 f"max_steps={2 if small else workload.steps}", *COMMON,
                 *workload.overrides]  # fmt: skip
    if small:
        overrides = [o for o in overrides if not o.startswith(GPU_ONLY)] + list(workload.tiny)
    last = {o.split("=", 1)[0]: o for o in overrides}  # a key set twice: its last value
    return [workload.recipe, "--config", workload.config, *last.values()]


def run_config(workload: Workload, run_args: list[str]):
    """The run's config as `freetx run` reads it (a schema instance)."""
    from freetx.cli.common import load_recipe
    from freetx.config.run_config import load_recipe_config

    return load_recipe_config(workload.config, run_args[3:], load_recipe(workload.recipe).schema)


def setup_of(cfg, device: str) -> tuple[str, str]:
    """(layout, precision) of a run's config, in words."""
    dist = cfg.distributed
    layout = [
        "1 GPU" if device == "cuda" else "1 CPU process",
        f"AC {dist.activation_checkpointing}",
    ]
    if dist.compile:
        layout.append("compile")
    if cfg.dataset.get("packed"):
        layout.append("packed")
    peft = cfg.peft  # every decoder recipe's schema has it (method none: all trains)
    if peft.method == "lora":
        layout.append(f"LoRA r{peft.rank} on {len(peft.target_modules)} kinds of linear")
    precision = [{"bfloat16": "bf16", "float32": "fp32"}.get(str(dist.mixed_precision.param_dtype),
                                                             str(dist.mixed_precision.param_dtype))]  # fmt: skip
    if dist.float8 != "none":
        precision.append(f"float8 {dist.float8}")
    if peft.quantize_base == "nf4":
        precision.append("NF4 base")
    return ", ".join(layout), " + ".join(precision)


def estimated_peak_gib(cfg, device: str) -> float:
    """`freetx estimate`'s peak of the config as run, on one rank of `device`, in GiB."""
    from freetx.planning.config import estimate_config

    found = estimate_config(cfg, 1, device)
    rows = [r for r in found.rows if r.strategy == cfg.distributed.strategy]
    if not rows:
        raise RuntimeError(f"the estimate refuses it: {found.refused}")
    return (rows[0].peak + found.judges) / GIB


def read_metrics(path: Path, warmup: int, device: str) -> dict:
    """The medians of a run's training steps after `warmup`, and its memory peak."""
    steps = step_records(path)
    if not steps:
        raise RuntimeError("the run logged no training step")
    keys = ["step_time_s", "tokens_per_s_per_device", "mfu_pct", "time/generation",
            "generation/tokens_per_s"]  # fmt: skip
    found = medians(steps, keys, after=warmup)
    memory = "memory/peak_reserved_gib" if device == "cuda" else "memory/max_rss_gib"
    found["peak_gib"] = max(r[memory] for r in steps)
    found["loss_first"], found["loss_last"] = steps[0].get("loss"), steps[-1].get("loss")
    if "time/generation" in found:
        found["generation_share"] = found.pop("time/generation") / found["step_time_s"]
        found["generation_tokens_per_s"] = found.pop("generation/tokens_per_s")
    return found


def first_row(workload: Workload, small: bool) -> dict:
    """A workload's row before it runs: what it is."""
    return {
        "name": workload.name,
        "recipe": workload.recipe,
        "config": workload.config,
        "shape": workload.shape
        + "".join(f" ({k}={v})" for k, v in workload.shape_fields)
        + (" (tiny)" if small else ""),
        "about": workload.about,
    }


def measure(workload: Workload, out: Path, device: str, small: bool, timeout: float) -> dict:
    """Run one workload; its row (an `error` instead of figures where it failed)."""
    row = first_row(workload, small)
    output_dir = out / "runs" / workload.name
    args = arguments(workload, model_folder(workload, out, small), output_dir, device, small)
    row["command"] = shlex.join(["freetx", "run", *args])
    started = time.perf_counter()
    try:
        cfg = run_config(workload, args)
        row["layout"], row["precision"] = setup_of(cfg, device)
        row["seq_len"] = cfg.model.max_seq_len
        try:
            row["estimate_gib"] = estimated_peak_gib(cfg, "cpu" if small else "h200")
        except Exception as e:  # the estimate is a column; the run still tells
            row["estimate_error"] = f"{type(e).__name__}: {e}"
        log = out / "logs" / f"{workload.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as sink:
            done = subprocess.run([sys.executable, "-m", "freetx", "run", *args], stdout=sink,
                                  stderr=subprocess.STDOUT, timeout=timeout, check=False)  # fmt: skip
        if done.returncode != 0:
            tail = log.read_text().strip().splitlines()[-15:]
            raise RuntimeError("\n".join(tail) + f"\n(exit {done.returncode}; the log: {log})")
        row.update(read_metrics(output_dir / "metrics.jsonl", workload.warmup, device))
    except subprocess.TimeoutExpired:
        row["error"] = f"stopped after {timeout:.0f} s (the suite's time left)"
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
    row["wall_s"] = round(time.perf_counter() - started, 1)
    return row


def compare(rows: list[dict]) -> None:
    """DPO's step time against its SFT workload's (the same positions per step), in place."""
    by_name = {r["name"]: r for r in rows}
    for row in rows:
        other = by_name.get(BY_NAME[row["name"]].vs or "")
        if other and row.get("step_time_s") and other.get("step_time_s"):
            row["vs"] = f"{row['step_time_s'] / other['step_time_s']:.2f}x {other['name']}'s step"


def fmt(value, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def notes(row: dict) -> str:
    found = [row["about"]]
    if "generation_share" in row:
        found.append(f"generation {100 * row['generation_share']:.0f}% of the step, engine "
                     f"{fmt(row.get('generation_tokens_per_s'))} tokens/s")  # fmt: skip
    if "vs" in row:
        found.append(row["vs"])
    if "estimate_error" in row:
        found.append("no estimate: " + row["estimate_error"].splitlines()[-1][:160])
    if "error" in row:
        found.append("FAILED: " + row["error"].strip().splitlines()[-1][:200])
    return "; ".join(found)


def markdown(rows: list[dict], machine: dict) -> str:
    header = ["workload", "recipe", "shape", "layout", "precision", "seq", "tokens/s/GPU",
              "MFU %", "peak GiB", "estimate GiB", "notes"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r["name"], r["recipe"], r["shape"], r.get("layout", "-"), r.get("precision", "-"),
                 str(r.get("seq_len", "-")), fmt(r.get("tokens_per_s_per_device")),
                 fmt(r.get("mfu_pct"), 1), fmt(r.get("peak_gib"), 2), fmt(r.get("estimate_gib"), 2),
                 notes(r)]  # fmt: skip
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    about = ", ".join(f"{k} {v}" for k, v in machine.items())
    commands = "\n".join(f"- `{r['name']}`: `{r['command']}`" for r in rows if "command" in r)
    return f"{about}\n\n" + "\n".join(lines) + f"\n\nCommands:\n\n{commands}\n"


def machine(device: str, small: bool) -> dict:
    import torch

    about = {"device": platform.processor() or platform.machine(), "torch": torch.__version__}
    if small:
        about["sizes"] = "tiny (2 layers, width 64, seq 128, 2 steps; no compile, no float8)"
    if device == "cuda":
        about["device"] = torch.cuda.get_device_name(0)
        about["cuda"] = torch.version.cuda
    try:
        import torchao

        about["torchao"] = torchao.__version__
    except ImportError:
        pass
    about["date"] = time.strftime("%Y-%m-%d")
    return about


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="results.json, results.md, runs")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, 2 steps (the plumbing)")
    p.add_argument("--quick", action="store_true", help="one workload per recipe")
    p.add_argument("--only", action="append", choices=sorted(BY_NAME), help="these (repeatable)")
    p.add_argument("--budget-s", type=float, default=480.0, help="start nothing after this")
    args = p.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: this machine has no CUDA device (--device cpu --tiny runs "
                    "the plumbing on the CPU)")  # fmt: skip
    chosen = [BY_NAME[n] for n in args.only] if args.only else WORKLOADS
    chosen = quick_list(chosen) if args.quick else chosen
    args.out.mkdir(parents=True, exist_ok=True)
    about = machine(args.device, args.tiny)
    rows: list[dict] = []
    start = time.perf_counter()
    for workload in chosen:
        left = args.budget_s - (time.perf_counter() - start)
        if left <= 0:
            rows.append(first_row(workload, args.tiny) | {
                "error": f"not run: the suite's --budget-s {args.budget_s:.0f} was spent"})  # fmt: skip
        else:
            print(f"[{time.perf_counter() - start:6.0f} s] {workload.name} ...", flush=True)
            rows.append(r := measure(workload, args.out, args.device, args.tiny, left))
            print(f"    {fmt(r.get('tokens_per_s_per_device'))} tokens/s/device, MFU "
                  f"{fmt(r.get('mfu_pct'), 1)}%, peak {fmt(r.get('peak_gib'), 2)} GiB (estimate "
                  f"{fmt(r.get('estimate_gib'), 2)}){'  FAILED' if 'error' in r else ''}",
                  flush=True)  # fmt: skip
        compare(rows)
        (args.out / "results.json").write_text(
            json.dumps({"machine": about, "rows": rows}, indent=1)
        )
        (args.out / "results.md").write_text(markdown(rows, about))
    print((args.out / "results.md").read_text())
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""The generation engine (`freetx.models.engine`) against today's generator (the static
batch: `generate(..., engine=EngineConfig(paged=False))`) and transformers' `generate`,
measured side by side in one run.

- engine: GRPO-shaped work, one process, fp32, random weights from one HF Llama folder
  per shape (`--shapes`: tiny = 4 layers, hidden 192, vocab 259, 1.6M parameters; 100m =
  12 layers, hidden 768, 12 heads / 4 KV, vocab 32000, 101M): 32 prompts of 24-64 tokens
  x 8 completions = 256 rows, sampled at temperature 1 for up to 256 new tokens. The
  lengths are skewed as real ones are: the output layer is scaled to near-uniform logits
  and 1.5% of the vocabulary ends a row, so most rows end early (median ~45 tokens) and
  a few run to the limit. Figures: generated tokens / second; how many completions are
  the static batch's token for token (near-uniform logits over 32000 tokens put some
  draws within float32's rounding of a token boundary: one token differs, and the rest
  of that completion); KV memory held (the engine: the most blocks held
  at once; the static batch: every row at the longest prompt + 256); prefill per group
  (the engine reads each prompt once, the static batch 8 times: tokens and seconds);
  transformers' `generate` on the same folder with its static cache
  (`cache_implementation="static"`, the same end ids; its own sampling, so its own
  lengths: tokens / second of what it generated, one run). The static batch and the
  engine alternate `--repeats` times, the best of each counts (the machine is shared:
  the best is the run other work disturbed least).
- grpo: a step of `llm/grpo_tiny` (random weights, 2 processes) and of `llm/hf_tiny_grpo`
  (a tiny Llama folder, LoRA, 2 processes), 4 steps each with the static batch and with
  the engine: the share of the step in generation (steps 2-4), and the largest
  difference of the logged reward, loss and completion length between the two, step by
  step (keyed draws: the same rollouts).

    OMP_NUM_THREADS=2 python benchmarks/generation.py                  # ~20 minutes on 2 cores
    OMP_NUM_THREADS=2 python benchmarks/generation.py --shapes tiny --section engine
    python benchmarks/generation.py --device cuda           # a GPU: 0.6B and 1.7B shapes, bf16

On a GPU (`--device cuda`): Qwen3-0.6B's and -1.7B's decoder shapes (random weights), bf16,
256 slots, the engine's step compiled with CUDA graphs, against transformers' `generate`
with its static cache and `torch.compile(mode="reduce-overhead")`; and the fraction of
the HBM-bandwidth limit: the bytes of the weights and of the keys and values each decode
step reads, summed over the run, over its time, against the device's published peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, table  # noqa: E402

SHAPES = {
    "tiny": dict(vocab_size=259, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=6, num_key_value_heads=2),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4),
}  # fmt: skip
# on a GPU (--device cuda): Qwen3-0.6B's and Qwen3-1.7B's decoder shapes, random weights
GPU_SHAPES = {
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, head_dim=128,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8),
    "1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, head_dim=128,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8),
}  # fmt: skip
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # published peaks
PROMPTS, GROUP, NEW_TOKENS, END_SHARE = 32, 8, 256, 0.015


def hf_folder(root: Path, shape: str) -> Path:
    """A random Llama folder of the shape, its tied output layer scaled to near-uniform
    logits (the lengths' skew comes from the end ids)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SHAPES, **GPU_SHAPES}[shape], max_position_embeddings=512,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.02)
    model.save_pretrained(root / shape)
    return root / shape


def workload(vocab: int):
    g = torch.Generator().manual_seed(1)
    prompts = [
        [1, *torch.randint(3, vocab, (int(n) - 1,), generator=g).tolist()]
        for n in torch.randint(24, 65, (PROMPTS,), generator=g)
    ]
    ends = list(range(vocab - max(1, round(END_SHARE * vocab)), vocab))
    return prompts, ends


def engine_section(shapes: list[str], repeats: int) -> None:
    """Section: the engine vs the static batch vs transformers' generate."""
    import transformers

    from freetx.checkpoint import load_model
    from freetx.models.engine import EngineConfig
    from freetx.models.generation import Draws, Sampling, generate

    threads = torch.get_num_threads()
    rows_out, memory, prefill = [], [], []
    for shape in shapes:
        with tempfile.TemporaryDirectory() as tmp:
            folder = hf_folder(Path(tmp), shape)
            model = load_model(folder, "cpu").eval()
            hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        vocab = SHAPES[shape]["vocab_size"]
        prompts, ends = workload(vocab)
        rows = [p for p in prompts for _ in range(GROUP)]
        draws = Draws.keyed([f"row {i}" for i in range(len(rows))], NEW_TOKENS)
        sampling = Sampling(1.0)
        timed = {}
        for _ in range(repeats):  # alternating; the best of each (the least disturbed)
            for name, paged in (("static", False), ("engine", True)):
                engine = EngineConfig(paged=paged)
                started = time.perf_counter()
                out = generate(model, rows, NEW_TOKENS, sampling, ends, draws, engine=engine)
                seconds = time.perf_counter() - started
                timed[name] = min(
                    timed.get(name, (seconds, out)), (seconds, out), key=lambda x: x[0]
                )
        (static_s, static), (engine_s, engine) = timed["static"], timed["engine"]
        same = sum(a == b for a, b in zip(engine.replies(), static.replies()))
        tokens = int(engine.lengths.sum())
        hf_tokens, hf_s = hf_generate(hf, rows, ends)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        lengths = engine.lengths.float()
        rows_out.append([
            f"{shape} ({params:.0f}M)", f"{tokens:,} (median {lengths.median():.0f}, "
            f"{int((lengths == NEW_TOKENS).sum())} at {NEW_TOKENS})",
            f"{same} of {len(rows)}", f"{int(static.lengths.sum()) / static_s:,.0f}",
            f"{tokens / engine_s:,.0f}", f"{hf_tokens / hf_s:,.0f}",
            f"{static_s / engine_s:.2f}x", f"{(tokens / engine_s) / (hf_tokens / hf_s):.2f}x",
        ])  # fmt: skip
        per_token = engine.stats.block_bytes // 16
        dense = len(rows) * (max(map(len, prompts)) + NEW_TOKENS) * per_token  # its new_cache
        held = engine.stats.most_kv_bytes
        memory.append(
            [shape, f"{dense / 2**20:,.1f}", f"{held / 2**20:,.1f}", f"{held / dense:.2f}x"]
        )
        prefill.append([shape, *prefill_times(model, prompts)])
    print(f"generation: {PROMPTS} prompts x {GROUP} completions, up to {NEW_TOKENS} new tokens, "
          f"fp32, one process, {threads} threads")  # fmt: skip
    print(table(rows_out, ["model", "tokens generated", "same as static", "static tok/s", "engine tok/s",
                           "transformers static-cache tok/s", "engine/static",
                           "engine/transformers"]))  # fmt: skip
    print("KV memory held at most (MiB): the static batch's dense cache vs the engine's blocks")
    print(table(memory, ["model", "static batch", "engine", "ratio"]))
    print(f"prefill of one group ({GROUP} completions of a prompt), the mean over the prompts")
    print(table(prefill, ["model", "static: tokens", "static: ms", "engine: tokens", "engine: ms"]))


def gpu_section(shapes: list[str], repeats: int) -> None:
    """Section (--device cuda): the engine in bf16 at 256 slots, compiled with CUDA graphs,
    vs transformers' generate with its static cache and torch.compile; and the fraction
    of the HBM-bandwidth limit the engine's decode steps reach (the bytes of the weights
    and of the keys and values each step reads, over its time)."""
    import transformers

    from freetx.checkpoint import load_model
    from freetx.models.engine import EngineConfig
    from freetx.models.generation import Draws, Sampling, generate

    name = torch.cuda.get_device_name()
    bandwidth = next((b for key, b in HBM_BYTES_PER_S.items() if key in name), None)
    rows_out = []
    for shape in shapes:
        with tempfile.TemporaryDirectory() as tmp:
            folder = hf_folder(Path(tmp), shape)
            model = load_model(folder, "cuda").to(torch.bfloat16).eval()
            hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        hf = hf.cuda().eval()
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
        prompts, ends = workload(GPU_SHAPES[shape]["vocab_size"])
        rows = [p for p in prompts for _ in range(GROUP)]
        draws = Draws.keyed([f"row {i}" for i in range(len(rows))], NEW_TOKENS)
        engine = EngineConfig(slots=len(rows))  # 256 slots; compile None: CUDA graphs
        best = None
        for _ in range(repeats + 1):  # the first compiles
            torch.cuda.synchronize()
            started = time.perf_counter()
            out = generate(model, rows, NEW_TOKENS, Sampling(1.0), ends, draws, engine=engine)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            best = seconds if best is None or seconds < best else best
        tokens = int(out.lengths.sum())
        hf_best = None
        for _ in range(repeats + 1):
            hf_tokens, hf_s = hf_generate(hf, rows, ends)
            hf_best = hf_s if hf_best is None or hf_s < hf_best else hf_best
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        # each decode step reads the weights and every running row's keys and values
        kv_tokens = sum(len(r) * n + n * (n - 1) / 2 for r, n in zip(rows, out.lengths.tolist()))
        per_token = out.stats.block_bytes / EngineConfig.block_size
        moved = out.stats.decode_steps * weights + kv_tokens * per_token
        limit = f"{moved / best / bandwidth:.0%}" if bandwidth else "-"
        rows_out.append([shape, f"{tokens:,}", f"{tokens / best:,.0f}",
                         f"{hf_tokens / hf_best:,.0f}", f"{(tokens / best) / (hf_tokens / hf_best):.2f}x",
                         f"{moved / best / 1e12:.2f}", limit])  # fmt: skip
    print(f"generation on {name}: {PROMPTS} prompts x {GROUP}, up to {NEW_TOKENS} new tokens, "
          f"bf16, {len(rows)} slots, the best of {repeats} runs after one that compiles")  # fmt: skip
    print(table(rows_out, ["model", "tokens", "engine tok/s", "transformers (static cache, "
                           "compiled) tok/s", "ratio", "TB/s read", "of the HBM limit"]))  # fmt: skip


def hf_generate(hf, rows: list[list[int]], ends: list[int]) -> tuple[int, float]:
    """transformers' generate with its static cache: the rows left-padded in one batch."""
    longest = max(map(len, rows))
    device = next(hf.parameters()).device
    ids = torch.tensor([[0] * (longest - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in rows], device=device)
    torch.manual_seed(0)
    started = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                          top_k=0, max_new_tokens=NEW_TOKENS, eos_token_id=ends, pad_token_id=0,
                          cache_implementation="static")  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    new = out[:, longest:]
    ended = torch.isin(new, torch.tensor(ends, device=device))
    first_end = torch.where(ended.any(1), ended.float().argmax(1) + 1, new.shape[1])
    return int(first_end.sum()), seconds


def prefill_times(model, prompts: list[list[int]]) -> list[str]:
    """The mean prefill of one group: the static batch reads the prompt 8 times (one
    forward over 8 rows through a dense cache), the engine once (one row, paged)."""
    from freetx.models.kv_cache import KVCache
    from freetx.models.paged_cache import BlockPool, PagedRows

    static, paged = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            started = time.perf_counter()
            model(
                ids.expand(GROUP, -1),
                cache=KVCache(len(model.layers), len(prompt), torch.zeros(GROUP, dtype=torch.long)),
            )
            static.append(time.perf_counter() - started)
            pool = BlockPool(len(model.layers), 8, 16)
            started = time.perf_counter()
            model(
                ids,
                cache=PagedRows(pool, torch.arange(1, 8)[None], torch.zeros(1, dtype=torch.long)),
            )
            paged.append(time.perf_counter() - started)
    mean_len = statistics.mean(map(len, prompts))
    return [f"{GROUP} x {mean_len:.0f}", f"{1e3 * statistics.mean(static):.1f}",
            f"1 x {mean_len:.0f}", f"{1e3 * statistics.mean(paged):.1f}"]  # fmt: skip


JSONL = "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"
COMMON = ["max_steps=4", "log_every_n_steps=1", "eval.every_n_steps=0", "eval.max_batches=1",
          "samples.every_n_steps=0", "checkpoint.every_n_steps=0", JSONL]  # fmt: skip
VOWEL = "rewards=[{_component_: freetx.objectives.RegexFormat, pattern: '(?s).*[aeiou].*'}]"


def grpo_runs(root: Path) -> dict[str, list[str]]:
    """The two configs' overrides: grpo_tiny from random weights, hf_tiny_grpo on a tiny
    Llama folder with a tokenizer and prompts of its own."""
    from freetx.data.corpus import builtin_documents
    from tests.hf_folders import make_folder, make_tokenizer

    folder = make_folder(root / "llama", "llama3_2")
    make_tokenizer(folder, builtin_documents()[:20])
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Write about {w}."}) + "\n"
                               for w in builtin_documents()[0].split()[:64]))  # fmt: skip
    return {
        "llm/grpo_tiny": ["model_dir=null", VOWEL],
        "llm/hf_tiny_grpo": [f"model_dir={folder}", f"dataset.source={prompts}", VOWEL,
                             "generation.max_completion_length=32"],
    }  # fmt: skip


def grpo_section() -> None:
    """Section: a GRPO step, static batch vs engine: generation's share, same metrics."""
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for config, overrides in grpo_runs(root).items():
            found = {}
            for name, paged in (("static", "false"), ("engine", "true")):
                out = root / f"{config.replace('/', '_')}_{name}"
                command = [sys.executable, "-m", "freetx", "run", "--nproc-per-node", "2",
                           "grpo_fsdp2", "--config", config, f"output_dir={out}", *COMMON,
                           *overrides, f"generation.engine.paged={paged}"]  # fmt: skip
                env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
                # the launcher's threads: 1 per process of 2 (2 each would oversubscribe)
                result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
                if result.returncode != 0:
                    raise RuntimeError(result.stdout[-2000:] + result.stderr[-3000:])
                lines = (out / "metrics.jsonl").read_text().splitlines()
                found[name] = {r["step"]: r for r in map(json.loads, lines) if "loss" in r}
            static, engine = found["static"], found["engine"]
            diff = max(abs(engine[s][k] - static[s][k]) for s in static
                       for k in ("reward", "loss", "completions/mean_length"))  # fmt: skip
            shares = []
            for run in (static, engine):
                steps = [run[s] for s in run if s >= 2]
                generation = statistics.mean(r["time/generation"] for r in steps)
                total = statistics.mean(r["time/rollout"] + r["time/training"] for r in steps)
                shares.append((generation, total))
            rows_out.append([
                config, f"{shares[0][0]:.3f} / {shares[0][1]:.3f} ({100 * shares[0][0] / shares[0][1]:.0f}%)",
                f"{shares[1][0]:.3f} / {shares[1][1]:.3f} ({100 * shares[1][0] / shares[1][1]:.0f}%)",
                f"{diff:.1e}",
            ])  # fmt: skip
    print("a GRPO step, 2 processes, steps 2-4: generation s / step s (share), and the largest "
          "difference of reward, loss, mean completion length over steps 1-4")  # fmt: skip
    print(table(rows_out, ["config", "static batch", "engine", "max |difference|"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--section", choices=("engine", "grpo"), default=None)
    p.add_argument("--shapes", default="tiny,100m")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args()
    if args.device == "cuda":  # the GPU figures: 0.6B and 1.7B shapes in bf16
        gpu_section(
            ["0.6b", "1.7b"] if args.shapes == "tiny,100m" else args.shapes.split(","), args.repeats
        )
        return
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    if args.section in (None, "engine"):
        engine_section(args.shapes.split(","), args.repeats)
    if args.section in (None, "grpo"):
        grpo_section()


if __name__ == "__main__":
    main()

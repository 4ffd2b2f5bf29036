"""`generate` with and without its KV cache on CPU, through the CLI as a user runs it:
a tiny HF folder at the decoder's `tiny` shape (4 layers, hidden 192, 6 heads / 2 KV,
vocabulary 259: byte tokens), read natively (Llama) and through the generic transformers
path (StarCoder2 at the same shape); greedy, 128 new tokens per sample (no EOS stop),
fp32, one thread. One 64-token prompt (BOS + 63 bytes); and 4 prompts of 64, 51, 41 and
31 tokens x 2 samples: one left-padded batch of 8 with the cache, 4 batches of 2 without
(a full forward batches prompts of equal length only). The figure is the recipe's own:
generated tokens / seconds of generation (start-up and loading aside), the best of 2 runs
(the machine is shared: the best is the figure other work disturbs least).

    OMP_NUM_THREADS=1 python benchmarks/kv_cache.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, table  # noqa: E402

SHAPE = dict(vocab_size=259, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
             tie_word_embeddings=True, bos_token_id=256, eos_token_id=257, pad_token_id=258)  # fmt: skip
PATHS = {"native (llama)": "LlamaConfig", "generic (starcoder2)": "Starcoder2Config"}
PROMPT = "The quick brown fox jumps over the lazy dog; then it ran far aw"  # 63 bytes
BATCHES = {"1 prompt": [PROMPT], "4 prompts x 2": [PROMPT[:n] for n in (63, 50, 40, 30)]}


def folder(root: Path, config_class: str) -> Path:
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**SHAPE)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root / config_class)
    return root / config_class


def tokens_per_second(checkpoint: Path, out: Path, prompts: list[str], cache: bool) -> float:
    listed = "[" + ",".join(repr(p) for p in prompts) + "]"
    result = subprocess.run(
        [sys.executable, "-m", "freetx", "run", "generate", "--config", "llm/hf_generate", f"checkpoint={checkpoint}",
        "tokenizer={_component_: freetx.data.ByteTokenizer}", "chat=false", "temperature=0",
        f"prompts={listed}", f"samples_per_group={2 if len(prompts) > 1 else 1}",
        "max_new_tokens=128", "stop_at_eos=false", f"kv_cache={str(cache).lower()}",
        f"output_dir={out}", "device=cpu"],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-4000:])
    return float(re.search(r"\(([\d.]+) tokens/s\)", result.stdout).group(1))


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for path, config_class in PATHS.items():
            checkpoint = folder(root, config_class)
            for batch, prompts in BATCHES.items():
                speed = {
                    cache: max(
                        tokens_per_second(
                            checkpoint, root / f"out{len(rows)}_{cache}_{i}", prompts, cache
                        )
                        for i in range(2)
                    )
                    for cache in (True, False)
                }
                rows.append([path, batch, f"{speed[True]:.0f}", f"{speed[False]:.0f}",
                             f"{speed[True] / speed[False]:.1f}x"])  # fmt: skip
    print("generate, tiny shape, 128 new tokens per sample, greedy, fp32, 1 thread, best of 2")
    print(table(rows, ["path", "batch", "KV cache tok/s", "full forward tok/s", "speed-up"]))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

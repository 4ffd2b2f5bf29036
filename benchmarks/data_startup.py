"""Start-up with a large text source: the first run (tokenizes into the token cache) vs the
second (maps the cache), launch to exit of a one-step run.

Writes a `.jsonl` of `--size-mb` MB of documents (slices of the built-in corpus at random
offsets, lengths log-normal around 4,000 characters) and a fresh cache folder in a
temporary directory (both deleted at the end), then runs, on `--nproc` gloo processes:

    freetx run --nproc-per-node N full_finetune_fsdp2 --config llm/tiny \
        dataset.source=<file> max_steps=1 eval.max_batches=1 ...

three times: on the built-in corpus (the fixed cost: processes, model, one step), on the
file with an empty cache, and on the file again. Prints seconds per run, the cache's
size, and the rate of the first run's tokenization (byte tokenizer, tiny model).

    python benchmarks/data_startup.py [--size-mb 1024] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, table  # noqa: E402


def write_corpus(path: Path, size_mb: int, seed: int = 0) -> int:
    """Documents of built-in text at random offsets until `size_mb` MB; their count."""
    from freetx.data import read_documents

    text = "\n".join(read_documents("builtin"))
    rng = random.Random(seed)
    written, count, target = 0, 0, size_mb * 10**6
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            length = min(int(rng.lognormvariate(8.3, 0.6)), len(text) // 2)  # median ~4,000
            start = rng.randrange(len(text) - length)
            line = json.dumps({"text": text[start : start + length]}) + "\n"
            f.write(line)
            written += len(line)
            count += 1
    return count


def timed_run(source: str, nproc: int, cache: Path, output_dir: Path) -> tuple[float, str]:
    """Seconds from launch to exit of a one-step run, and its token cache line."""
    cmd = [sys.executable, "-m", "freetx", "run", "--nproc-per-node", str(nproc),
           "full_finetune_fsdp2", "--config", "llm/tiny", f"dataset.source={source}",
           "max_steps=1", "eval.max_batches=1", "metric_loggers=[]", "resume=never",
           f"output_dir={output_dir}", "checkpoint.every_n_steps=0",
           "checkpoint.save_final=false"]  # fmt: skip
    env = {**os.environ, "FREETX_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"the run failed:\n{result.stderr[-4000:]}")
    found = re.search(r"token cache: .*", result.stdout + result.stderr)
    return seconds, found.group(0) if found else "token cache: builtin, not cached"


def open_seconds(source: Path, cache: Path) -> float:
    """Seconds to make llm/tiny's train and validation datasets from a warm cache."""
    from freetx.data import ByteTokenizer, PackedTextDataset

    start = time.perf_counter()
    for split in ("train", "validation"):
        data = PackedTextDataset(ByteTokenizer(), str(source), 128, split, cache_dir=str(cache))
        assert data.token_cache.state == "hit", data.token_cache.line()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write the corpus and cache (a temp dir)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="data_startup_", dir=args.dir))
    try:
        source = work / "corpus.jsonl"
        start = time.perf_counter()
        docs = write_corpus(source, args.size_mb)
        print(f"corpus: {source.stat().st_size / 1e6:,.0f} MB, {docs:,} documents, written in "
              f"{time.perf_counter() - start:.0f} s")  # fmt: skip
        cache = work / "cache"
        rows, lines = [], []
        for name, src in (("builtin corpus", "builtin"), ("first run (cache empty)", source),
                          ("second run (cache hit)", source)):  # fmt: skip
            seconds, line = timed_run(str(src), args.nproc, cache, work / "run")
            rows.append([name, f"{seconds:.1f}"])
            lines.append(line)
        print(table(rows, ["run", "launch to exit s"]))
        print("\n".join(lines[1:]))
        size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
        built = float(re.search(r"built (?:by another process )?in ([0-9.]+) s", lines[1])[1])
        print(
            f"cache: {size / 1e6:,.0f} MB on disk; built in {built:.0f} s (reading, "
            f"tokenizing, writing: {source.stat().st_size / 1e6 / max(built, 1e-9):.1f} MB/s; "
            f"one process builds, the other {args.nproc - 1} wait)"
        )
        print(
            f"both splits' datasets from the cache, in this process: {open_seconds(source, cache):.2f} s"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Per-block torch.compile on llm/tiny_llama_bench: steady tokens/s and compile time, at 1
and 2 processes (2 cores), eager vs compiled with inductor's cache cold and warm.

Compile time = the compiled run's first step minus the eager run's first step (both
include their first-step costs; the difference is what compiling added). A cold cache is
a fresh TORCHINDUCTOR_CACHE_DIR (a user's first run); warm is the same folder again.

    python benchmarks/compile.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import table  # noqa: E402
from benchmarks.tune_workload import freetx_round  # noqa: E402

COMPILE = "distributed.compile=true"


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in (1, 2):
            threads = {"OMP_NUM_THREADS": str(2 // nproc)}  # the 2 cores, shared out
            eager = freetx_round(Path(tmp), nproc=nproc, env=threads)
            cache = {**threads, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(dir=tmp)}
            cold = freetx_round(Path(tmp), COMPILE, nproc=nproc, env=cache)
            warm = freetx_round(Path(tmp), COMPILE, nproc=nproc, env=cache)
            for name, r in (("eager", eager), ("compile, cold cache", cold),
                            ("compile, warm cache", warm)):  # fmt: skip
                rows.append([nproc, name, f"{r['tokens_per_s']:,.0f}",
                             f"{r['tokens_per_s'] / eager['tokens_per_s']:.2f}",
                             f"{r['step1_s']:.1f}", f"{r['step1_s'] - eager['step1_s']:.1f}",
                             f"{r['startup_s']:.1f}"])  # fmt: skip
    print("llm/tiny_llama_bench (batch 16 x 256, fp32, FSDP2 per block), one run each")
    print(table(rows, ["procs", "", "tokens/s", "ratio", "step 1 s", "compile s",
                       "launch->step 1 s"]))  # fmt: skip


if __name__ == "__main__":
    main()

"""`make bench`: every benchmark, one after the other; each prints its own table.

Benchmarks print ratios measured side by side in one run; they are not tests
and assert nothing. Numbers depend on the machine: compare ratios, not seconds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = [
    "overhead.py", "memory.py", "activation_checkpointing.py", "checkpoint.py", "hf_io.py",
    "peft.py", "crosscoder.py", "estimate.py", "compile.py", "tune_workload.py",
    "attention_kernels.py", "hf_paths.py", "kv_cache.py", "dpo.py", "episodes.py",
]  # fmt: skip


def main() -> int:
    failed = []
    for name in BENCHMARKS:
        print(f"\n== {name} ==", flush=True)
        if subprocess.run([sys.executable, str(HERE / name)]).returncode != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

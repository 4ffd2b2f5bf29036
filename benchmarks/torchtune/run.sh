#!/usr/bin/env bash
# One run of torchtune 0.6.1's full_finetune_distributed on the tiny_llama_bench workload,
# set up as README.md says in $TTBENCH (default /tmp/ttbench). Prints one JSON line:
# steady tokens/s (steps 6-30, all ranks), launch -> end of step 1 (s), peak RSS of a rank.
set -euo pipefail
TTBENCH=${TTBENCH:-/tmp/ttbench}
PY=${PYTHON:-$(command -v python)}
export PYTHONPATH=$TTBENCH/site:$(dirname "$0") OMP_NUM_THREADS=1 TT_TIMES=$TTBENCH/times.jsonl
rm -rf "$TT_TIMES" "$TTBENCH/out"
launch=$($PY -c 'import time; print(time.time())')
$PY -m torch.distributed.run --standalone --nproc-per-node 2 "$TTBENCH/full_finetune_distributed.py" \
  --config "$(dirname "$0")/tiny_llama.yaml" output_dir="$TTBENCH/out" \
  checkpointer.checkpoint_dir="$TTBENCH/ckpt" > "$TTBENCH/stdout.log" 2>&1
$PY - "$TT_TIMES" "$launch" <<'PY'
import json, sys
records = [json.loads(x) for x in open(sys.argv[1])]
t = {r["step"]: r["time"] for r in records if "step" in r}
rss = next(r["rss_mib"] for r in records if "rss_mib" in r)
print(json.dumps({"tokens_per_s": 25 * 2 * 8 * 256 / (t[30] - t[5]),
                  "startup_s": t[1] - float(sys.argv[2]), "rss_mib": rss}))
PY

#!/usr/bin/env bash
# The packages freetx needs that the GPU machine's image lacks (torchao, omegaconf,
# torchdata), as wheels for its Python 3.12 in .whl/ (git-ignored), at the versions this
# checkout's environment has. A GPU session carries them (docs/performance.md, "On a GPU"):
#   bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
versions=$("$python" -c 'from importlib.metadata import version as v
print(" ".join(f"{n}=={v(n)}" for n in ("torchao", "omegaconf", "torchdata")))')
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl $versions
ls .whl

# freetx: set-up, demo, tests, benchmarks.
#   make demo    train the Free Transformer on 2 CPU processes, then sample (sets up first)
#   make test    run the test suite (sets up first)
# TORCH picks the torch build installed before the package; the default is the
# CPU build these machines carry. On a GPU machine: make setup TORCH=torch==2.13.0
# from the CUDA index, e.g. TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128".

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.freetx-installed

.PHONY: setup test test-slow lint format demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

# two pytest workers (pytest-xdist), each given whole test files (their module fixtures are
# built once): the suite's launches leave a core idle about half the time on 2 cores
WORKERS ?= 2
PYTEST := $(BIN)/pytest -n $(WORKERS) --dist loadfile --durations=30

test: setup
	$(PYTEST)

# the slow tier: every PEFT method end to end, long acceptance runs, real SLURM
test-slow: setup
	$(PYTEST) -m slow

lint: setup
	$(BIN)/ruff check freetx recipes tests benchmarks docs/examples
	$(BIN)/ruff format --check freetx recipes tests benchmarks docs/examples

format: setup
	$(BIN)/ruff check --fix freetx recipes tests benchmarks docs/examples
	$(BIN)/ruff format freetx recipes tests benchmarks docs/examples

# the Free Transformer on the letter-block task (~8 min on 2 cores), then samples from it
demo: setup
	$(BIN)/freetx run --nproc-per-node 2 full_finetune_fsdp2 --config free_transformer/tiny
	$(BIN)/freetx run generate --config free_transformer/generate checkpoint=runs/free_transformer_tiny

bench: setup
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info runs

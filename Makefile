# Set-up and the two main commands. Everything installs from PyPI / this machine's wheel cache.
PY ?= python3
VENV ?= .venv
VPY = $(VENV)/bin/python
STAMP = $(VENV)/.installed

.PHONY: setup demo lint test test-slow bench coverage coverage-full clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "torch==2.13.0"
	$(VPY) -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

## The main job: train a small CNN on the xla device (CPU PJRT backend).
demo: $(STAMP)
	PJRT_DEVICE=CPU $(VPY) examples/train_mnist_xla.py --fake_data --num_epochs 1 --num_steps 60

## Lint: pyflakes errors (unused imports, undefined names), unused arguments of the public modules, and the import layering contracts.
lint: $(STAMP)
	$(VENV)/bin/ruff check torch_xla tests bench tools examples
	$(VENV)/bin/lint-imports

## The test suite (lint first; fast; slow sweeps are marked and run by `make test-slow`).
test: lint
	PJRT_DEVICE=CPU $(VPY) -m pytest -q tests
	XLA_TEST_SPMD=1 PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 $(VPY) -m pytest -q tests/spmd

test-slow: $(STAMP)
	PJRT_DEVICE=CPU $(VPY) -m pytest -q -m slow tests

## Op coverage against PyTorch's OpInfo database (docs/op_coverage.md); -full: every sample.
coverage: $(STAMP)
	PJRT_DEVICE=CPU $(VPY) tools/op_coverage.py --samples 2 --out docs/op_coverage.md

coverage-full: $(STAMP)
	PJRT_DEVICE=CPU $(VPY) tools/op_coverage.py --full --jobs 2 --out build/op_coverage_full.md --json build/op_coverage_full.json

bench: $(STAMP)
	PJRT_DEVICE=CPU $(VPY) bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info

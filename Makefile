# Two commands set everything up on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/c4_ablation.py:rw_lr,preset=tiny
WORKDIR ?= runs/demo
ARGS ?=

.PHONY: setup train test test-fast params bench gpu-check gpu-wheels clean distclean

# What training needs. The tests' extra adds pytest and, on Linux x86-64, libtpu (the TPU compiler, for the tests
# that compile for a TPU slice); training installs neither.
$(VENV)/.installed: pyproject.toml
	$(call install,.)

# One install of everything (one resolve, not two): it holds what training needs too.
$(VENV)/.installed-test: pyproject.toml
	$(call install,'.[test]')
	touch $(VENV)/.installed

# pip byte-compiles every installed module on one core; compileall does it on all cores and, like pip, goes on past
# a file that does not compile.
define install
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -e $(1)
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	touch $@
endef

# Everything: training and the tests.
setup: $(VENV)/.installed-test

# Trains the tiny Table 5 RW+LR model on the Python standard library (bytes), on CPU, in a few minutes.
train: $(VENV)/.installed
	$(PY) -m laurel.main --config=$(CONFIG) --workdir=$(WORKDIR) $(ARGS)

# The whole suite, one pytest session on 2 workers; worksteal moves the tests queued on a busy worker to an idle one.
test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2 --dist worksteal tests

# The inner loop: every test but the slow ones (end to end, or long: docs/testing.md; pytest -m slow).
test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2 --dist worksteal -m 'not slow' tests

# Parameter counts of every Table 5 row, as the README's table (ARGS=--json: one JSON object per row).
params: $(VENV)/.installed
	@$(PY) scripts/params.py --table=c4_ablation $(ARGS)

bench: $(VENV)/.installed
	$(PY) scripts/benchmark.py --out results/benchmark_cpu.json

# On a machine with an NVIDIA GPU: the GPU tests, then Table 5's step at 32 x 1024 tokens per device into
# results/benchmark_<gpu>.json (docs/gpu.md). It runs .venv's Python (pip install -e '.[cuda,test]' there) or, on an
# image that has JAX with CUDA, the one PYTHON names (make gpu-check PYTHON=python3). PART=tests or bench: one half;
# PART=profile: scripts/gpu_profile.py, the step's kernels by group and A/B jobs, into results/gpu_profile_<gpu>.json.
gpu-check:
	scripts/gpu_check.sh $(or $(PART),all)

# The wheels an image with JAX, CUDA and Flax lacks (CPython 3.12, manylinux x86-64), into .whl/ (docs/gpu.md).
gpu-wheels:
	scripts/gpu_wheels.sh

# The virtual environment; runs/ (checkpoints of trained models) stays: `make distclean` removes it too.
clean:
	rm -rf $(VENV)

distclean: clean
	rm -rf runs

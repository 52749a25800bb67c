# Two commands set everything up on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/c4_ablation.py:rw_lr,preset=tiny
WORKDIR ?= runs/demo
ARGS ?=

.PHONY: setup train test params bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

# Trains the tiny Table 5 RW+LR model on the Python standard library (bytes), on CPU, in a few minutes.
train: setup
	$(PY) -m laurel.main --config=$(CONFIG) --workdir=$(WORKDIR) $(ARGS)

test: setup
	$(PY) -m pytest -q -n 2 tests

params: setup
	@for row in baseline_24 baseline_28 rw lr pa rw_lr rw_lr_pa; do \
	  $(PY) -m laurel.params --config=configs/c4_ablation.py:$$row; done

bench: setup
	$(PY) scripts/benchmark.py --out results/benchmark_cpu.json

clean:
	rm -rf $(VENV) runs

# Two entry points for a fresh machine: `make demo` and `make test`.
# Each creates .venv/ on first use and installs torch 2.13.0 explicitly first, so pip never
# resolves a newer (multi-GB CUDA) build, then this package with its test extras.

PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.spmd_installed
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor

.PHONY: demo test bench install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PYTHON) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 examples/train_transformer.py

test: $(STAMP)
	$(PYTHON) -m pytest -q -ra --durations=25 -n 2 --dist load

bench: $(STAMP)
	$(PYTHON) tools/bench.py

clean:
	rm -rf $(VENV) .cache build *.egg-info

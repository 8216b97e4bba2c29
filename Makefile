# Quickstart targets: `make demo` and `make test` work on a fresh clone (CPU only).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on local disk; installing it first means no dependency can pull
# a multi-GB CUDA build from the registry.
TORCH_VERSION ?= 2.13.0
# One stamp per install: the demo needs the package alone, the tests its `test` extra too.
STAMP_BASE := $(VENV)/.sparsp-installed
STAMP_TEST := $(VENV)/.sparsp-installed-test

.PHONY: demo test gpu-test soak doc-outputs install clean

$(STAMP_BASE): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e .
	@touch $(STAMP_BASE)

$(STAMP_TEST): $(STAMP_BASE)
	$(PY) -m pip install -q -e ".[test]"
	@touch $(STAMP_TEST)

install: $(STAMP_TEST)

demo: $(STAMP_BASE)
	$(VENV)/bin/sparsp analyze --model hunyuan-video --ranks 8 --out results/demo

test: $(STAMP_TEST)
	$(PY) -m pytest -q

# On a machine with CUDA GPUs: the `gpu`-marked tests and a GPU soak, with the machine's own
# python and torch (PYTHON=...), not the CPU venv.
gpu-test:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh tests

soak: $(STAMP_TEST)
	$(PY) -m pytest -q -s -m slow --soak-calls 5000 tests

# The documents' tables that take minutes to remake (docs/analysis.md), against the code.
doc-outputs: $(STAMP_TEST)
	$(PY) -m pytest -q -m slow --doc-outputs tests/test_doc_outputs.py

clean:
	rm -rf $(VENV) results build src/*.egg-info

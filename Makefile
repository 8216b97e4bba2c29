# Quickstart targets: `make demo` and `make test` work on a fresh clone (CPU only).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on local disk; installing it first means no dependency can pull
# a multi-GB CUDA build from the registry.
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.sparsp-installed

.PHONY: demo test soak install clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[test]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sparsp analyze --model hunyuan-video --ranks 8 --out results/demo

test: $(STAMP)
	$(PY) -m pytest -q

soak: $(STAMP)
	SPARSP_SOAK_CALLS=5000 $(PY) -m pytest -q -s -m slow tests

clean:
	rm -rf $(VENV) results build src/*.egg-info

# `make test` and `make bench` work from a fresh clone on a machine with only Python.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Installed only when the venv has no torch yet; on this project's CPU machines this is a local
# CPU wheel. Override (e.g. TORCH_SPEC="torch --index-url ...") or preinstall your own torch.
TORCH_SPEC ?= torch==2.13.0

.PHONY: test bench install install-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install --quiet -e ".[plot]"
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install --quiet -e ".[test,plot]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

test: install-test
	$(PY) -m pytest -q

bench: install
	$(PY) -m opsd_rollout bench --output bench-results/rollout.json --plot bench-results \
		--trace bench-results/trace.json

clean:
	rm -rf $(VENV) bench-results .pytest_cache .hypothesis

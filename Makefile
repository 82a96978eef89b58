# `make train`, `make test` and `make bench` work from a fresh clone on a machine with only Python.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Installed only when the venv has no torch yet; on this project's CPU machines this is a local
# CPU wheel. Override (e.g. TORCH_SPEC="torch --index-url ...") or preinstall your own torch.
TORCH_SPEC ?= torch==2.13.0
# The floor environment: the oldest release of every dependency (requirements/floor.txt) on Python 3.12,
# the lent GPU machine's stack. Any python3.12 works; pyenv's is found when none is on the PATH.
FLOOR_PYTHON ?= $(shell python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null || PYENV_VERSION=$$(pyenv versions --bare 2>/dev/null | grep '^3\.12' | tail -1) python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null || echo python3)
FLOOR_VENV ?= .venv-floor

.PHONY: train test test-slow test-all test-floor bench perf install install-test gpu-bundle clean

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

$(FLOOR_VENV)/.installed: pyproject.toml requirements/floor.txt
	rm -rf $(FLOOR_VENV)
	$(FLOOR_PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install --quiet -c requirements/floor.txt -e ".[test,plot]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# The fast tier (every test that starts no process, runs no inductor compile and no benchmark; a test that does
# fails at once unless marked slow) and the slow tier; test-all is both. `make test` first type-checks the public
# surface (pyproject's [tool.mypy] files): about a minute cold, seconds once .mypy_cache holds torch's types.
test: install-test
	$(PY) -m mypy
	$(PY) -m pytest -q -m "not slow"

test-slow: install-test
	$(PY) -m pytest -q -m slow

test-all: install-test
	$(PY) -m pytest -q

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -c "import sys, torch, transformers; print('floor:', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"
	$(FLOOR_VENV)/bin/python -m pytest -q -m "not slow"

# The built-in distillation run (the README's main job): a teacher trained by SFT on the Python documentation (or
# the one cached in ~/.cache/opsd-rollout), distilled into a smaller student in runs/student; its last lines say
# where the student model, metrics.jsonl and eval.png are.
train: install
	$(PY) -m opsd_rollout train --output-dir runs/student

bench: install
	$(PY) -m opsd_rollout bench --output bench-results/rollout.json --plot bench-results \
		--trace bench-results/trace.json

# The regression guard (not a test, not in CI): the kernels and the smoke bench, each config in 6 fresh processes,
# against the committed baselines in benchmarks/perf/, through compare's interval over the processes; one verdict, its
# last line. Run it on a quiet machine before landing a change to the engine, the loss or the step.
perf: install
	$(PY) scripts/perf.py

gpu-bundle: install
	$(PY) scripts/gpu_bundle.py --output .gpu-bundle

clean:
	rm -rf $(VENV) $(FLOOR_VENV) .gpu-bundle bench-results perf-results runs/student .pytest_cache .hypothesis

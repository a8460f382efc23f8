PY := .venv/bin/python
PIP := .venv/bin/pip

.PHONY: venv test demo bench lint clean chromium rulecheck compat compat-hf docs plots

venv: .venv/.done
.venv/.done: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	touch $@

# The single-process tests run on every core (pytest-xdist); the multi-process (gloo) ones, marked
# slow, after them one at a time: each already runs a process per rank.
test: venv chromium
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -x -n auto -m "not slow" --durations=15 tests
	$(PY) -m pytest -q -x -m slow --durations=15 tests

# The HTML plan test renders in headless Chromium; install it where we can (root + apt), else the
# test skips with a message.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; } \
		|| echo "note: Chromium not installed; the HTML render test will be skipped"

demo: venv
	$(PY) -m fxshard demo

# The API reference from the docstrings (docs/api; the concept pages are docs/*.md): build/docs.
docs: venv
	$(PY) -m sphinx -W --keep-going -q -b html docs/api build/docs

# The benchmark page's plots (docs/img/*.svg), drawn from its tables; matplotlib only here.
plots: venv
	$(PIP) install -q "matplotlib>=3.8,<4"
	$(PY) benchmarks/plots.py

bench: venv
	$(PY) benchmarks/planner.py

rulecheck: venv
	$(PY) scripts/rule_check.py

# Another torch release (not in CI): its own venv, from the package index (the CUDA wheels of torch
# 2.11 / 2.12 / 2.15 need their nvidia-* packages even to import on a CPU machine: ~5 GB), then
# the tests that run on simulated ranks.  `make compat COMPAT_TORCH=2.11.0` for another release.
# A machine whose pip configuration caps torch (a constraints file) gets the release asked for
# here: this venv's installs read no pip configuration file (PIP_CONFIG_FILE=/dev/null), the main
# venv's still do.
COMPAT_TORCH ?= 2.15.0
COMPAT := .venv-torch$(COMPAT_TORCH)
COMPAT_PIP := PIP_CONFIG_FILE=/dev/null $(COMPAT)/bin/pip
compat:
	test -x $(COMPAT)/bin/python || python3 -m venv $(COMPAT)
	$(COMPAT_PIP) install -q torch==$(COMPAT_TORCH)
	$(COMPAT_PIP) install -q -e ".[test]"
	$(COMPAT)/bin/python -m pytest -q -m "not slow" tests

# Another transformers release (not in CI: the tests pin the one in pyproject.toml): installed
# into its own folder, which shadows the venv's transformers and its hub libraries (torch stays),
# then the transformers tests, on simulated ranks and on gloo ranks.
# `make compat-hf COMPAT_HF=5.25.0`.
COMPAT_HF ?= 5.25.0
COMPAT_HF_DIR := .venv-transformers$(COMPAT_HF)
compat-hf: venv
	test -f $(COMPAT_HF_DIR)/.done || { $(PIP) install -q --target $(COMPAT_HF_DIR) \
		transformers==$(COMPAT_HF) && touch $(COMPAT_HF_DIR)/.done; }
	PYTHONPATH=$(COMPAT_HF_DIR) $(PY) -c "import transformers; print('transformers', transformers.__version__)"
	PYTHONPATH=$(COMPAT_HF_DIR) $(PY) -m pytest -q -n auto -m "not slow" tests/test_hf.py
	PYTHONPATH=$(COMPAT_HF_DIR) $(PY) -m pytest -q -m slow tests/test_hf.py tests/test_user_paths.py -k "transformers or hf"

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf .venv .venv-torch* build *.egg-info

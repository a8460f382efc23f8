PY := .venv/bin/python
PIP := .venv/bin/pip

.PHONY: venv test demo bench lint clean

venv: .venv/.done
.venv/.done: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	touch $@

test: venv
	$(PY) -m ruff check .
	$(PY) -m pytest -q -x tests

demo: venv
	$(PY) -m fxshard demo

bench: venv
	$(PY) benchmarks/planner.py

lint: venv
	$(PY) -m ruff check .

clean:
	rm -rf .venv build *.egg-info

PY := .venv/bin/python
PIP := .venv/bin/pip

.PHONY: venv test demo bench lint clean chromium rulecheck

venv: .venv/.done
.venv/.done: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	touch $@

test: venv chromium
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -x tests

# The HTML plan test renders in headless Chromium; install it where we can (root + apt), else the
# test skips with a message.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; } \
		|| echo "note: Chromium not installed; the HTML render test will be skipped"

demo: venv
	$(PY) -m fxshard demo

bench: venv
	$(PY) benchmarks/planner.py

rulecheck: venv
	$(PY) scripts/rule_check.py

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf .venv build *.egg-info

# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck typecheck-minimal pytest bench bench-quick clean

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $(STAMP)

# `mypy --strict` must pass without the optional extras too (issue 12). A second venv holds only
# the base dependencies from pyproject.toml (torch pinned as in requirements-dev.txt: the CPU
# build, from local disk); .venv's mypy checks eventbus against it. About 25 s to build.
MIN_VENV := $(VENV)/minimal
MIN_STAMP := $(MIN_VENV)/.installed
MYPY_MIN := $(VENV)/bin/mypy --python-executable $(MIN_VENV)/bin/python \
	--cache-dir .mypy_cache/minimal eventbus

$(MIN_STAMP): pyproject.toml requirements-dev.txt | $(STAMP)
	test -x $(MIN_VENV)/bin/python || $(PYTHON) -m venv $(MIN_VENV)
	$(PY) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"], sep="\n")' > $(MIN_VENV)/requirements.txt
	grep '^torch==' requirements-dev.txt > $(MIN_VENV)/constraints.txt
	$(MIN_VENV)/bin/python -m pip install -q -r $(MIN_VENV)/requirements.txt -c $(MIN_VENV)/constraints.txt
	touch $(MIN_STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP) $(MIN_STAMP)
	$(VENV)/bin/ruff check eventbus tests benchmarks examples
	$(VENV)/bin/ruff format --check eventbus tests benchmarks examples
	$(VENV)/bin/mypy eventbus
	$(MYPY_MIN)
	$(PY) -m pytest -q -m "not soak"

typecheck-minimal: $(MIN_STAMP)
	$(MYPY_MIN)

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m benchmarks --json docs/benchmarks.json --plot docs/step_time.png --doc docs/performance.md

bench-quick: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m benchmarks --quick

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

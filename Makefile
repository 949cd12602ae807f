# The two commands a newcomer needs: `make demo` and `make test`.
# Both set everything up first (a .venv with CPU torch where there is no GPU).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test typecheck docs bench clean

setup:
	./scripts/setup.sh

demo: setup
	$(PY) -m gossipnet.cli demo

test: setup docs
	$(PY) -m ruff check gossipnet tests bench examples scripts
	$(PY) -m mypy gossipnet
	$(PY) -m pytest -q -p no:cacheprovider

# The API reference, from the docstrings (pdoc): build/api/index.html (git-ignored).
# Fails on an import error or a pdoc warning; 7-21 s on 2 shared cores. Modules: scripts/build_api_docs.py.
docs: setup
	$(PY) scripts/build_api_docs.py build/api

# Settings in pyproject.toml [tool.mypy]; ~20 s CPU on a clean clone, under 1 s cached.
typecheck: setup
	$(PY) -m mypy gossipnet

bench: setup
	for b in bench/[a-z]*.py; do echo "== $$b"; $(PY) $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) runs build/api .pytest_cache .ruff_cache .mypy_cache .hypothesis

# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
# `make test` runs the tests, then installs the built wheel alone and runs its entry points.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-all ab venv

venv: $(VENV)/.installed

$(VENV)/.installed: setup.cfg setup.py pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh $(VENV)

demo: venv
	$(PY) -m fxdream demo

test: venv
	$(PY) -m pytest -q -p no:cacheprovider; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests were collected (pytest exit 5)"; exit 1; fi; exit $$rc
	bash scripts/wheel_smoke.sh $(VENV)

test-all: venv
	$(PY) -m pytest -q -p no:cacheprovider -m "slow or not slow"

ab: venv
	$(PY) -m pytest -q -p no:cacheprovider -m ab

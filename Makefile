# Set-up and everyday commands. Each target creates .venv on first use.
#   make demo   train the tiny GPT with ZeRO-3 on a local Ray cluster of 2 CPU workers
#   make test   install the test extras and run the whole suite (what CI runs)
# Nothing here touches RAY_AUTH_MODE: Ray's token authentication stays on for a user's run (a new
# local cluster turns it on and keeps its token in ~/.ray/auth_token). The test suite turns it off
# for itself only (tests/conftest.py).
PYTHON ?= python3
VENV ?= .venv
# A fresh clone pins torch to its CPU build; pass CONSTRAINTS= to keep the torch you have.
CONSTRAINTS ?= constraints-cpu.txt
PIP_C := $(if $(CONSTRAINTS),--constraint $(CONSTRAINTS),)

.PHONY: demo test venv
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet $(PIP_C) -e '.[test,peers]'
	$(VENV)/bin/python -m raydeep.tier.cpu_update --build
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/raydeep demo

# tests/ray runs beside the other tests, in a second pytest process (tests/run_suite.sh says why).
test: venv
	tests/run_suite.sh $(VENV)/bin/python

# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv first
# when anything is missing; re-running is a no-op once the stamp is newer than the pins.
# sglang is installed last, without its dependencies (README: which of its pins are overridden and why);
# --no-warn-conflicts keeps pip from listing sglang's unmet pins on a re-install.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.slime-spec-installed
SMOKE ?= 0
PYTEST_ARGS ?=
TEST_WORKERS ?= 2

.PHONY: venv demo test test-nightly doctor clean-venv

venv: $(STAMP)

$(STAMP): requirements.txt setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-warn-conflicts -r requirements.txt
	$(PY) -m pip install -q --no-deps sglang==0.5.23
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

demo: venv
	$(PY) -m slime_spec.demo $(if $(filter 1,$(SMOKE)),--smoke,)

# The per-commit suite (CI); the nightly tier holds heavier variants of what it covers (pytest.ini: nightly).
test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not nightly" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing on purpose"; exit 1; fi; exit $$rc

test-nightly: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m nightly $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing on purpose"; exit 1; fi; exit $$rc

clean-venv:
	rm -rf $(VENV)

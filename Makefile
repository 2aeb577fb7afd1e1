# One virtual environment for everything: `make demo` and `make test` install it on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# The lock: the exact versions of every dependency that the tests pass with. `make lock` refreshes it.
LOCK := constraints.txt
EXTRAS := offline,dev,eval,bench
# Extras built from source (minutes on 2 cores): `make test` installs them, the lock pins them.
SOURCE_EXTRAS := llamacpp
# The CPU build of torch, which lies on this machine's disk; installed first, else a plain `torch`
# requirement pulls a multi-GB CUDA build. `make lock` keeps it.
TORCH := torch==2.13.0
LOCK_VENV := .lock-venv
# Offline by default: nothing below reaches the network (no analytics, no hub look-ups).
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export ANONYMIZED_TELEMETRY ?= False
export RAGAS_DO_NOT_TRACK ?= true
export LANGGRAPH_CLI_NO_ANALYTICS ?= 1
export LANGGRAPH_NO_VERSION_CHECK ?= 1

# llama.cpp for the llamacpp: backend, built for this CPU. Without ggml's AMX kernels: on this project's Xeons
# (AMX) they crash on the offline model's Q4_K matrices.
# (The flags only where the compiler knows them: x86 compilers recent enough to build AMX code at all.) Built
# without pip's wheel cache, which keys a build by the sdist alone and would hand back one built with other flags.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMACPP_CFLAGS := $(shell $(CC) $(NO_AMX) -E -x c /dev/null >/dev/null 2>&1 && echo "$(NO_AMX)")
LLAMACPP_BUILD := CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_TOOLS=OFF" CFLAGS="$(LLAMACPP_CFLAGS) $(CFLAGS)" CXXFLAGS="$(LLAMACPP_CFLAGS) $(CXXFLAGS)" \
	CMAKE_BUILD_PARALLEL_LEVEL=$(shell nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2) \
	PIP_NO_CACHE_DIR=1

.PHONY: install llamacpp demo test test-all lint studio lock clean

# Re-runs when pyproject.toml or the lock changes: pip then moves every locked package to its pinned version.
$(VENV)/.installed: pyproject.toml $(LOCK)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -c $(LOCK) $(TORCH)  # first: see TORCH above
	$(PY) -m pip install -q -c $(LOCK) -e '.[$(EXTRAS)]'
	touch $@

install: $(VENV)/.installed

$(VENV)/.llamacpp: $(VENV)/.installed
	$(LLAMACPP_BUILD) $(PY) -m pip install -q -c $(LOCK) -e '.[$(EXTRAS),$(SOURCE_EXTRAS)]'
	touch $@

llamacpp: $(VENV)/.llamacpp

# The demo runs the offline model on llama.cpp (its build takes a few minutes once): twice as fast as transformers
# on a CPU (benches/results/first_answer.json).
demo: llamacpp
	$(VENV)/bin/ermedrag demo

# Two workers (pytest-xdist), each test file on one of them (its module fixtures start once); tests/conftest.py
# gives each worker its share of the cores. TEST_WORKERS=0 runs the tests in this one process.
TEST_WORKERS ?= 2
PYTEST := $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile

# The fast suite: every part against its real component (Chroma on disk and as a server, real HTTP servers, the
# checkpointer, a real trainer step), the slow real-model runs and what needs llama.cpp's source build left out.
test: install lint
	$(PYTEST) -m "not slow and not llamacpp"

# Everything: the fast suite, then real-model runs, real model servers and the llamacpp: backend.
test-all: install llamacpp
	$(PYTEST)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

studio: install
	$(VENV)/bin/langgraph dev --port 8123 --no-browser

# Refresh the lock: resolve the newest versions that pyproject.toml allows in a throwaway venv (torch stays
# $(TORCH)) and pin what got installed. Then `make test` installs the new pins; commit $(LOCK) if green.
lock:
	rm -rf $(LOCK_VENV)
	python3 -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q -U pip
	# Only what our extras require gets pinned: drop the venv's own setuptools (torch requires one: it comes back).
	$(LOCK_VENV)/bin/python -m pip uninstall -q -y setuptools
	$(LOCK_VENV)/bin/python -m pip install -q $(TORCH)
	$(LLAMACPP_BUILD) $(LOCK_VENV)/bin/python -m pip install -q -e '.[$(EXTRAS),$(SOURCE_EXTRAS)]'
	{ printf '%s\n' \
	  '# The lock: every dependency of ermedrag[$(EXTRAS),$(SOURCE_EXTRAS)] at the exact version that the tests pass' \
	  '# with (CPython 3.11, Linux x86_64). `make install` installs with `pip install -c $(LOCK)`, $(TORCH) (the CPU' \
	  '# build, from the wheels on disk) first. Written by `make lock`: a throwaway venv resolved afresh by pip, then' \
	  '# `pip freeze --all --exclude-editable` less pip. Refresh: `make lock && make test`; commit it if green.'; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable | grep -v '^pip=='; } > $(LOCK_VENV)/lock.txt
	! grep -n ' @ ' $(LOCK_VENV)/lock.txt  # a direct URL or local path would not install elsewhere
	mv $(LOCK_VENV)/lock.txt $(LOCK)
	rm -rf $(LOCK_VENV)

clean:
	rm -rf $(VENV) $(LOCK_VENV) .pytest_cache .langgraph_api

# Set-up and everyday commands. Works on a fresh Debian machine with Python 3.11 and the package registries.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install sysdeps demo test bench clean

# Debian packages the tests and the multi-host parts need: redis-server (the Redis registry's
# tests start their own) and libibverbs1 (Mooncake's wheels link it even for TCP).
SYSDEPS := redis-server:/usr/bin/redis-server libibverbs1:/usr/lib/x86_64-linux-gnu/libibverbs.so.1

# torch is installed first, pinned to the CPU wheel these hosts carry (any other version pulls
# several GB of CUDA packages); the package's own range is then already satisfied.
# The editable install silences setuptools' "Editable installation" notice (information only: it
# says a meta path finder maps paramstore.backends to backends/).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || \
	  (apt-get update && apt-get install -y python3-venv && $(PYTHON) -m venv $(VENV))
	$(BIN)/python -m pip install --upgrade pip setuptools wheel
	$(BIN)/python -m pip install torch==2.13.0
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/python -m pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) sysdeps

sysdeps:
	@missing=""; for d in $(SYSDEPS); do test -e "$${d#*:}" || missing="$$missing $${d%%:*}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q $$missing; \
	  else echo "missing Debian packages:$$missing (apt-get install them; their tests are skipped)"; fi; \
	fi

demo: install
	$(BIN)/python examples/quickstart.py
	$(BIN)/python examples/async_rl.py

test: install
	$(BIN)/python -m pytest -q   # tests/, then the examples in docstrings and README.md

bench: install
	$(BIN)/python tools/bench_core.py
	$(BIN)/python tools/bench_retention.py
	$(BIN)/python tools/bench_remote.py
	$(BIN)/python tools/bench_transport.py
	$(BIN)/python tools/bench_peers.py
	$(BIN)/python tools/bench_sharded.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

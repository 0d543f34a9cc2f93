# Everything runs from a local virtual environment that `make install` builds from scratch.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

VLLM_VENV ?= .venv-vllm

.PHONY: install run test test-unit test-integration vllm-install test-vllm bench-vllm soak bench bench-docs nvcc-check bench-loop docs clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch (the machine's local wheel); CUDA machines bring their own torch.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(BIN)/.installed

# Run the daemon in the foreground on the embedded default (512 MiB region in /dev/shm/kvtierd).
run: install
	$(BIN)/kvtierd

# The whole test suite (unit + integration; GPU tests skip without CUDA).
test: install
	$(BIN)/pytest -q

test-unit: install
	$(BIN)/pytest -q tests/unit

test-integration: install
	$(BIN)/pytest -q tests/integration

# vLLM 0.33.0 for the plugin's tests, in its own venv (CPU torch, vLLM --no-deps + the packages its imports need).
$(VLLM_VENV)/.installed: pyproject.toml tools/install-vllm-cpu.sh
	PYTHON=$(PYTHON) bash tools/install-vllm-cpu.sh $(VLLM_VENV)
	touch $@

vllm-install: $(VLLM_VENV)/.installed

# The vLLM plugin against vLLM's own Scheduler and OffloadingConnector and a real kvtierd (CPU only).
test-vllm: vllm-install
	VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/pytest -q tests/vllm

# vLLM's real Scheduler with the kvtier plugin against vLLM's native CPU offloading, same run (docs/vllm.md).
bench-vllm: vllm-install
	VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/python bench/vllm_scheduler.py

# The long soak: 16 client processes (4 engines x TP=4, two namespaces) for 5 minutes under
# constant eviction; every loaded block verified by hash; prints its figures. CI runs an 8 s one.
soak: install
	$(BIN)/python tests/soak/soak.py --duration 300

NVCC ?= nvcc
# CI's compile check of the copy kernel for Hopper (sm_90): any error or warning fails.
nvcc-check:
	@mkdir -p build
	$(NVCC) -arch=sm_90 -std=c++17 -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror -c csrc/kvtier_copy.cu -o build/kvtier_copy.o

# Every benchmark section against its floor or peer measured in the same run (minutes).
# The redis section needs redis-server (apt-get install redis-server); it is skipped without it.
bench: install
	$(BIN)/kvtierctl bench

# A full run, then docs/benchmarks.md and its plots regenerated from it.
bench-docs: install
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/run_all.py

bench-loop: install
	$(BIN)/pip install -q uvloop
	$(BIN)/python bench/loop_choice.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .hypothesis

# Regenerate the settings reference and the example config from kvtierd/config.py.
docs: install
	$(BIN)/python -c "from kvtierd import config; open('docs/configuration.md','w').write(config.markdown()); open('deploy/kvtierd.example.toml','w').write(config.example_toml())"

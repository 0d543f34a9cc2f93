# Everything runs from a local virtual environment that `make install` builds from scratch.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

VLLM_VENV ?= .venv-vllm
SGLANG_VENV ?= .venv-sglang

.PHONY: install run test test-unit test-integration deploy-install test-deploy gpu-check vllm-install test-vllm bench-vllm sglang-install test-sglang tier-install test-tier bench-tier tier-up soak soak-hostile crash bench bench-docs nvcc-check bench-loop docs clean

# The compiled core (native/, built by setup.py into kvtierd/) is rebuilt when its sources change:
# an editable install does not rebuild a C extension by itself.
$(BIN)/.installed: pyproject.toml setup.py $(wildcard native/*.c native/*.h)
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

# The whole test suite (unit + integration; GPU tests skip without CUDA). The second-tier suite
# has its own target (test-tier): it needs the engines that tier-install brings; so has deploy/'s
# (test-deploy: promtool, systemd-nspawn, Helm's SDK).
test: install
	$(BIN)/pytest -q --ignore=tests/tier --ignore=tests/deploy

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

# SGLang 0.5.23 for the HiCache storage backend's tests, in its own venv (CPU torch, SGLang --no-deps +
# the pinned packages its imports need: tools/sglang-0.5.23-cpu-requirements.txt).
$(SGLANG_VENV)/.installed: pyproject.toml tools/install-sglang-cpu.sh tools/sglang-0.5.23-cpu-requirements.txt
	PYTHON=$(PYTHON) bash tools/install-sglang-cpu.sh $(SGLANG_VENV)
	touch $@

sglang-install: $(SGLANG_VENV)/.installed

# The backend against SGLang's own radix tree, HiCache controller and storage factory and a real kvtierd (CPU only).
test-sglang: sglang-install
	$(SGLANG_VENV)/bin/pytest -q tests/sglang

# What the deploy/ checks run: promtool (Debian's prometheus package, the binary alone),
# systemd-nspawn (systemd-container; root: apt-get), Helm's SDK and the Kubernetes schemas (venv).
$(BIN)/.deploy-installed: $(BIN)/.installed tools/install-deploy-tools.sh
	bash tools/install-deploy-tools.sh $(VENV)
	touch $@

deploy-install: $(BIN)/.deploy-installed

# deploy/ for real: the systemd unit booted under systemd-nspawn, `promtool test rules` of every
# alert, the Helm chart linted and rendered, its manifests validated.
test-deploy: deploy-install
	$(BIN)/pytest -q tests/deploy

# The second tier's engines: Debian's libibverbs1 and redis-server/redis-tools (root: apt-get), the
# Mooncake Store wheel and redis-py (the benchmark's floor) into the venv.
$(BIN)/.tier-installed: $(BIN)/.installed tools/install-tier.sh
	bash tools/install-tier.sh $(VENV)
	touch $@

tier-install: $(BIN)/.tier-installed

# Tier backends and the companion against real Mooncake Store and Redis Cluster processes on
# loopback (the fixtures start and stop them).
test-tier: tier-install
	$(BIN)/pytest -q tests/tier tests/unit/test_tier.py

# Demote and promote through two daemons against each engine's raw put/get, and the lookup-miss check
# (kvtierbench/tier.py, also `kvtierctl bench --only tier`; QUICK=1 for toy sizes).
bench-tier: tier-install
	$(BIN)/python -m kvtierbench.tier $(if $(QUICK),--quick)

# One second-tier server in the foreground for manual runs: make tier-up SERVER=mooncake|redis
tier-up: tier-install
	$(BIN)/python -m kvtierbench.tierservers $(or $(SERVER),mooncake)

# The long soak: 16 client processes (4 engines x TP=4, two namespaces) for 5 minutes under
# constant eviction; every loaded block verified by hash; prints its figures. CI runs an 8 s one.
soak: install
	$(BIN)/python tests/soak/soak.py --duration 300

# The randomised crash test (tests/crash/crash.py): engines storing and loading while the daemon is
# SIGKILLed and SIGTERMed and clients are SIGKILLed and SIGSTOPped at random; every loaded block
# verified; prints the totals. 60 s with the daemon watching its clients, then 60 s with the daemon in
# its own PID namespace (heartbeats and the grace period). CI runs 12 s of each. SEED=n repeats a run.
crash: install
	$(BIN)/python tests/crash/crash.py --duration 60 $(if $(SEED),--seed $(SEED))
	$(BIN)/python tests/crash/crash.py --duration 60 --pidns $(if $(SEED),--seed $(SEED))

# The hostile soak: good engines verify every block while an attacker process cycles through issue 11's
# attacks (bad frames, floods of connections, sessions and jobs, borrowed identities, a truncated region
# file, ...) for 75 s; prints daemon alive, RSS and fd range, wrong blocks. CI runs a 15 s one.
soak-hostile: install
	$(BIN)/python tests/soak/hostile_soak.py --duration 75

# The one GPU check (tools/gpu_check.py): tests/gpu, the SGLang and vLLM GPU checks where those import,
# bench/gpu_bench.py; one JSON and one Markdown summary in OUT, under 8 minutes. Runs with the
# machine's own Python (torch, CuPy) from a bare checkout: no install, no registry; WHEELS=dir
# installs what does not import from a wheel directory. On a machine without CUDA every GPU step is
# reported skipped, with the reason. docs/cuda.md says where the figures go.
GPU_PYTHON ?= python3
OUT ?= out/gpu-check
gpu-check:
	$(GPU_PYTHON) tools/gpu_check.py --out $(OUT) $(if $(WHEELS),--wheels $(WHEELS))

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
# The policy section replays the request traces of ../shared/data/traces (TRACES=... for others).
TRACES ?= $(wildcard ../shared/data/traces/*.jsonl)

bench-docs: install
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/run_all.py $(foreach t,$(TRACES),--trace $(t))

bench-loop: install
	$(BIN)/pip install -q uvloop
	$(BIN)/python bench/loop_choice.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) build *.egg-info .pytest_cache .hypothesis kvtierd/_native.*.so

# Regenerate the settings reference and the example config from kvtierd/config.py.
docs: install
	$(BIN)/python -c "from kvtierd import config; open('docs/configuration.md','w').write(config.markdown()); open('deploy/kvtierd.example.toml','w').write(config.example_toml())"

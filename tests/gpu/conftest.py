"""GPU tests: collected only where torch sees a CUDA device (the project's CI machines
have none). On a GPU machine, with the conformance suite for cuda_ipc:

    WEIGHTPULL_DRIVERS=cuda_ipc,cuda_ipc_host python -m pytest tests/conformance tests/gpu

On a machine without one, tests/test_cuda_ipc.py checks that the driver says why."""

import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]

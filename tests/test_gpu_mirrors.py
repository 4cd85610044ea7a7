"""Which transport a puller's mirror reads through: the driver itself for a host mirror or
a driver that lands bytes on the GPU; HostStaged (pinned host memory, then a copy to the
GPU per bucket) for a GPU mirror of any other. tests/gpu/ pulls through it on a GPU."""

import pytest
import torch

from weightpull import InProcessRegistry, Puller
from weightpull.drivers.fake import FakeTransport
from weightpull.errors import DriverUnavailableError


def test_a_host_mirror_reads_through_the_driver_itself():
    t = FakeTransport()
    assert Puller(InProcessRegistry(), t).transport is t
    assert Puller(InProcessRegistry(), t, staging=True).transport is t  # nothing to stage into


def test_a_driver_that_lands_bytes_on_the_gpu_is_not_staged():
    class Direct(FakeTransport):
        reads_into_gpu = True

    t = Direct()
    assert Puller(InProcessRegistry(), t, device="cuda:0").transport is t
    plain = FakeTransport()
    assert Puller(InProcessRegistry(), plain, device="cuda:0", staging=False).transport is plain


def test_a_gpu_mirror_of_host_reads_is_staged_or_says_why_not():
    t = FakeTransport()
    if torch.cuda.is_available():
        from weightpull.integrations.torch_staging import HostStaged

        staged = Puller(InProcessRegistry(), t, device="cuda:0").transport
        assert isinstance(staged, HostStaged) and staged.inner is t and staged.name == "fake"
        return
    with pytest.raises(DriverUnavailableError, match="mirror on cuda:0 cannot be fed from 'fake'.*no CUDA device"):
        Puller(InProcessRegistry(), t, device="cuda:0")

"""Examples in docs/ that a user copies run as written: here docs/guides/vllm.md's registry
served from the trainer's own process, on every interface with keys, read by a replica
that holds a reader key and names the trainer's line."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import anyio
import pytest

from weightpull import InvalidArgumentError, Puller, create_transport
from weightpull.drivers.zmq_registry.server import RegistryServer
from weightpull.registry import connect_registry

from .conftest import host_tensors
from .served import make_keys

pytestmark = pytest.mark.anyio

DOCS = Path(__file__).resolve().parents[1] / "docs" / "guides"


def example(page: str, heading: str) -> str:
    """The first python block under `heading` in docs/guides/`page`."""
    text = (DOCS / page).read_text()
    section = text[text.index(heading) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


async def test_the_trainer_serves_its_registry_on_every_interface_with_keys(tmp_path, monkeypatch):
    if create_transport("nixl").unavailable_reason():
        pytest.skip("nixl cannot load here")
    code = example("vllm.md", "## Serving the registry from the trainer's own process")
    assert '"tcp://0.0.0.0:5603"' in code and 'keys="keys"' in code
    port = free_port()
    make_keys(tmp_path / "keys", ("reader", "replica-0"))
    monkeypatch.chdir(tmp_path)  # the example names its keys directory `keys`
    namespace: dict = {}
    exec(compile(code.replace(":5603", f":{port}"), "docs/guides/vllm.md", "exec"), namespace)
    pulled = anyio.Event()

    async def training():
        yield 1, host_tensors(1)
        await pulled.wait()  # the trainer keeps its slots while the replica reads

    async def replica():
        key = {"key": "keys/replica-0.key_secret", "server_key": "keys/registry.key"}
        async with connect_registry(f"tcp://127.0.0.1:{port}", **key) as registry:
            async with create_transport("nixl") as transport:
                await registry.wait_for_version(1, timeout=30, publisher="trainer")
                copy = await Puller(registry, transport, holder="replica-0", publisher="trainer").pull()
                assert {n: bytes(copy.view(n)) for n in host_tensors(1)} == {
                    n: t.data for n, t in host_tensors(1).items()
                }
        pulled.set()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(namespace["serve_and_train"], training())
            tg.start_soon(replica)


def test_development_mode_refuses_every_interface():
    """What the example avoids: without keys, a bind beyond loopback is refused, naming the fix."""
    with pytest.raises(InvalidArgumentError, match="loopback addresses only; serve with keys"):
        RegistryServer("tcp://0.0.0.0:5603", insecure_dev=True)

"""The served registry's bytes on the wire, kept: for every operation, the exact request
frames a `ZmqRegistry` sends and the reply frames a `RegistryServer` answers, recorded in
tests/wire_golden.json. What a message draws at random or from the wall clock (its id,
nonce, timestamp, the server's run epoch) is replaced, in the recorded copy alone, by
placeholders numbered in order of first use; the messages really exchanged are left as
they are. Leases and ages come from a fake clock and counted uuids.

A change that moves a single byte of a message fails here: peers of other releases read
these bytes. Record anew (`WEIGHTPULL_RECORD_GOLDEN=1`) only for a change of protocol."""

from __future__ import annotations

import base64
import itertools
import json
import os
import uuid
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from weightpull import Manifest, plan_layout
from weightpull.clock import FakeClock
from weightpull.errors import InvalidTransitionError, VersionNotFoundError
from weightpull.layout import TensorSpec
from weightpull.records import Reservation
from weightpull.registry import InProcessRegistry

pytest.importorskip("zmq")
from weightpull.drivers.zmq_registry import wire  # noqa: E402
from weightpull.drivers.zmq_registry.client import ZmqRegistry  # noqa: E402
from weightpull.drivers.zmq_registry.server import RegistryServer  # noqa: E402

pytestmark = pytest.mark.anyio
GOLDEN = Path(__file__).with_name("wire_golden.json")
KEY = b"golden-secret"


class Recorder:
    """Every message encoded, as the bytes it makes with its random fields numbered."""

    def __init__(self) -> None:
        self.messages: list[dict[str, str]] = []
        self._names: dict[tuple[str, Any], str] = {}

    def name(self, kind: str, value: Any) -> Any:
        if value is None:
            return None
        key = (kind, value)
        if key not in self._names:
            self._names[key] = f"{kind}{sum(k == kind for k, _ in self._names):012d}".ljust(32, "0")[:32]
        return self._names[key]

    def record(self, direction: str, op: str, frames: list[bytes]) -> None:
        assert len(frames) == 1
        self.messages.append(
            {"op": op, "dir": direction, "mac": frames[0][: wire.MAC_BYTES].hex(), "body": frames[0][32:].decode()}
        )


@pytest.fixture
def recorded(monkeypatch):
    recorder = Recorder()
    counter = itertools.count(1)
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=next(counter)))
    real_request, real_reply = wire.encode_request, wire.encode_reply
    ops: dict[str, str] = {}  # request id -> op, to name the replies

    def encode_request(key: bytes, req: wire.Request) -> list[bytes]:
        ops[req.id] = req.op
        fixed = attrs.evolve(
            req,
            id=recorder.name("id", req.id),
            nonce=recorder.name("nonce", req.nonce),
            ts=1.5e9,
            epoch=recorder.name("epoch", req.epoch),
        )
        recorder.record("request", req.op, real_request(key, fixed))
        return real_request(key, req)

    def encode_reply(key: bytes, rep: wire.Reply) -> list[bytes]:
        fixed = attrs.evolve(
            rep,
            id=recorder.name("id", rep.id),
            re=recorder.name("nonce", rep.re),
            nonce=recorder.name("rnonce", rep.nonce),
            ts=1.5e9,
            epoch=recorder.name("epoch", rep.epoch),
        )
        recorder.record("reply", ops.get(rep.id or "", "?"), real_reply(key, fixed))
        return real_reply(key, rep)

    monkeypatch.setattr(wire, "encode_request", encode_request)
    monkeypatch.setattr(wire, "encode_reply", encode_reply)
    return recorder


def manifest(version: int, slot: int = 0, *, buckets: int = 1, digests: bool = False) -> Manifest:
    specs = [TensorSpec(f"w{i}", "uint8", (8,)) for i in range(buckets)]
    sums = tuple(f"d{i}" for i in range(buckets)) if digests else None
    return Manifest(version, plan_layout(specs, bucket_bytes=8), "fake", b"{}", slot, "p", sums)


async def conversation(registry: ZmqRegistry) -> None:
    """One call or more of every operation, with and without each optional argument."""
    await registry.ping()
    await registry.keepalive(("p", "r"))
    await registry.reserve(Reservation("p", "fake", (b"slot-0", b"slot-1"), 64))
    await registry.reservations()
    v1 = await registry.begin(publisher="p", slot=0)
    await registry.commit(manifest(v1, digests=True))
    await registry.newest()
    await registry.newest(publisher="p")
    await registry.get(v1)
    lease = await registry.acquire(ttl=5.0, holder="r")
    placed = await registry.acquire(v1, ttl=5.0, holder="r2", host="h1", exclude=["x"], publisher="p")
    lease = await registry.renew(lease)
    await registry.is_valid(lease)
    await registry.release(lease)
    await registry.release_checked(placed)
    await registry.offer(v1, holder="relay", host="h2", descriptor=b"\x00mirror")
    await registry.readers_at(v1, "relay")
    await registry.withdraw(v1, holder="relay")
    await registry.report_serving("r", v1)
    await registry.wait_for_version(v1)
    await registry.wait_for_version(v1, publisher="p")
    await registry.begin(v1 + 1, publisher="p", slot=1)
    v2 = v1 + 1
    await registry.stream(manifest(v2, slot=1, buckets=2))
    await registry.mark(v2, 1)
    await registry.progress(v2)
    streaming = await registry.acquire(v2, ttl=5.0, holder="s", streaming=True)
    await registry.offer(v2, holder="relay2", host="h3", descriptor=b"m2", cap=3, landed=0)
    await registry.mark_offer(v2, 1, holder="relay2")
    await registry.progress(v2, source="relay2")
    await registry.wait_for_buckets(v2, 1)
    await registry.wait_for_buckets(v2, 1, source="relay2", publisher="p")
    await registry.mark(v2, 2)
    await registry.commit_stream(v2, ["d0", "d1"])
    await registry.release(streaming)
    await registry.retire(v2)
    await registry.reclaim(v1)
    v3 = await registry.begin(publisher="p", slot=0, shard=(0, 2))
    await registry.abort(v3, "gone", shard=(0, 2))
    v4 = await registry.begin(publisher="p", slot=2)
    await registry.stream(manifest(v4, slot=2))
    await registry.commit_stream(v4)
    await registry.status()
    with pytest.raises(VersionNotFoundError):
        await registry.get(99)
    with pytest.raises(InvalidTransitionError):
        await registry.retire(v3)
    # A rank's slice relayed (issue 33): appended, so every message before keeps its bytes.
    sliced = await registry.acquire(v4, ttl=5.0, holder="r5", host="h1", part="slice-k")
    await registry.offer(
        v4, holder="r5", host="h1", descriptor=b"m5", part="slice-k", digests=["blake2b128:" + "0" * 32]
    )
    await registry.part_digests(v4, "slice-k")
    await registry.release(sliced)


async def test_every_operation_keeps_its_bytes_on_the_wire(recorded):
    registry = InProcessRegistry(FakeClock(1000.0))
    with pytest.warns(DeprecationWarning):
        server = RegistryServer("tcp://127.0.0.1:0", secret=KEY, registry=registry)
        client = ZmqRegistry("tcp://127.0.0.1:1", secret=KEY, heartbeat=None, timeout=5.0)
    server.epoch = "e0e0e0e0e0e0e0e0"  # the run's name is in the words of an EpochMismatch
    async with anyio.create_task_group() as tg:
        client.address = await tg.start(server.serve)
        await conversation(client)
        await client.aclose()
        tg.cancel_scope.cancel()
    messages = recorded.messages
    assert {m["op"] for m in messages} == set(wire.OPS)  # every operation, asked and answered
    if os.environ.get("WEIGHTPULL_RECORD_GOLDEN"):
        GOLDEN.write_text(json.dumps(messages, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    for i, (got, want) in enumerate(zip(messages, golden, strict=False)):
        assert got == want, f"message {i} ({want['dir']} of {want['op']}) changed"
    assert len(messages) == len(golden)


def test_the_recorded_frames_are_what_a_peer_of_any_release_decodes():
    """Each recorded request decodes and checks out as its operation; each reply decodes."""
    for m in json.loads(GOLDEN.read_text()):
        frames = [bytes.fromhex(m["mac"]) + m["body"].encode()]
        if m["dir"] == "request":
            req = wire.decode_request(KEY, frames)
            assert req.op == m["op"]
            wire.check_args(req)
        else:
            wire.decode_reply(KEY, frames)


def test_a_descriptor_crosses_as_base64():
    offers = [m for m in json.loads(GOLDEN.read_text()) if m["op"] == "offer" and m["dir"] == "request"]
    assert json.loads(offers[0]["body"])["args"]["descriptor"] == base64.b64encode(b"\x00mirror").decode()

"""Hypothesis against a live registry server: random bytes, and messages that are well
formed but wrong in each way the protocol names. Every message gets exactly one error
reply, of the type the sans-IO checks predict; the server stays up and its state
never moves.

Bounded and derandomized by default; WEIGHTPULL_FUZZ=long explores at random, longer.
"""

from __future__ import annotations

import json
import os
import time

import anyio
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from weightpull import Lease, Manifest, plan_layout
from weightpull.errors import WeightpullError
from weightpull.layout import TensorSpec

zmq = pytest.importorskip("zmq")
from weightpull.drivers.zmq_registry import wire  # noqa: E402
from weightpull.drivers.zmq_registry.client import ZmqRegistry  # noqa: E402

from .served import SECRET, ServedRegistry  # noqa: E402

LONG = os.environ.get("WEIGHTPULL_FUZZ") == "long"
FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    **({"max_examples": 5000} if LONG else {"max_examples": 150, "derandomize": True, "database": None}),
)


def manifest(version: int, slot: int) -> Manifest:
    return Manifest(version, plan_layout([TensorSpec("w", "uint8", (8,))]), "fake", b"{}", slot, "trainer")


def snapshot(status) -> dict:
    d = status.to_dict()
    for v in d["versions"]:
        v.pop("age")
    for lease in d["leases"]:
        lease.pop("expires_in")
    d.pop("alive", None)  # seconds left: they move with time
    return d


class Live:
    """The server, a raw socket to throw messages with, and the state they must not move."""

    def __init__(self, served: ServedRegistry) -> None:
        self.served = served
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)
        self.sock.connect(served.address)
        self.window = wire.ReplayWindow()  # the oracle's copy of the server's
        self.baseline = anyio.run(self._setup)

    async def _setup(self) -> dict:
        reg = ZmqRegistry(self.served.address, secret=SECRET, heartbeat=None)
        await reg.begin(1, publisher="trainer", slot=0)
        await reg.commit(manifest(1, 0))
        await reg.acquire(ttl=600.0, holder="fuzz-holder")  # holds v1 past its retirement
        await reg.begin(2, publisher="trainer", slot=1)
        await reg.commit(manifest(2, 1))
        await reg.report_serving("replica-0", 1)
        status = snapshot(await reg.status())
        await reg.aclose()
        return status

    async def _state(self) -> dict:
        reg = ZmqRegistry(self.served.address, secret=SECRET, heartbeat=None)
        try:
            return snapshot(await reg.status())
        finally:
            await reg.aclose()

    def throw(self, frames: list[bytes]) -> wire.Reply:
        self.sock.send_multipart(frames)
        try:
            answer = self.sock.recv_multipart()
        except zmq.Again:
            raise AssertionError(
                f"no reply (server alive: {self.served.alive()})\n{self.served.log()[-2000:]}"
            ) from None
        return wire.decode_reply(SECRET, answer)  # signed by the server, whatever it says

    def expect(self, frames: list[bytes]) -> str | None:
        """The error the server must answer with, in its order of checks; None if valid."""
        try:
            req = wire.decode_request(SECRET, frames)
            self.window.admit(req.nonce, req.ts, time.time())
            if req.epoch != self.served.epoch:
                return wire.EPOCH_MISMATCH
            wire.check_args(req)
        except WeightpullError as exc:
            return type(exc).__name__
        return None

    def unchanged(self) -> None:
        assert self.served.alive()
        assert anyio.run(self._state) == self.baseline


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    # No liveness lapses while it runs: the replica's report must stay in the state compared.
    served = ServedRegistry(tmp_path_factory.mktemp("fuzzed-registry"), args=("--liveness-ttl", "1e9"))
    served.start()
    yield Live(served)
    assert served.alive()
    assert served.stop() == 0


edges = st.sampled_from([2**63, -(2**63), 10**400, 1e308, -1e308, 0, -1, "", [], {}])  # overflow, empty
json_values = edges | st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


def seal(body: bytes) -> list[bytes]:
    return [wire.mac(SECRET, body) + body]


def envelope(live: Live, op: str, args: dict, **change) -> dict:
    body = {
        "wp": wire.PROTOCOL,
        "type": "request",
        "id": os.urandom(8).hex(),
        "nonce": wire.new_nonce(),
        "ts": time.time(),
        "epoch": live.served.epoch,
        "op": op,
        "args": args,
    }
    return {**body, **change}


# Read-only operations with valid arguments: whatever is mutated, nothing can change.
READS = {
    "ping": {},
    "status": {},
    "newest": {},
    "get": {"version": 2},
    "is_valid": {"lease": Lease("x-1", 2, "h", 5.0, 1.0).to_dict()},
    "wait_for_version": {"min_version": 99, "timeout": 0},
}

# Well-typed requests the registry must refuse, each naming its error.
REFUSED = [
    ("begin", {"version": None, "publisher": "", "slot": 5}, "InvalidArgumentError"),
    ("begin", {"version": 9, "publisher": "trainer", "slot": 1}, "VersionInUseError"),
    ("commit", {"manifest": manifest(7, 0).to_dict()}, "VersionNotFoundError"),
    ("commit", {"manifest": {}}, "InvalidArgumentError"),
    ("commit", {"manifest": {**manifest(2, 1).to_dict(), "digests": ["00", "11"]}}, "InvalidArgumentError"),
    ("abort", {"version": 1, "reason": "no"}, "InvalidTransitionError"),
    ("retire", {"version": 9}, "VersionNotFoundError"),
    ("reclaim", {"version": 2}, "VersionInUseError"),
    ("reclaim", {"version": 1}, "VersionInUseError"),  # retired, but its lease is alive
    ("acquire", {"version": 1, "ttl": 5.0, "holder": "h"}, "VersionStateError"),
    ("acquire", {"version": None, "ttl": 0, "holder": "h"}, "InvalidArgumentError"),
    ("acquire", {"version": None, "ttl": 1e9, "holder": "h"}, "InvalidArgumentError"),
    ("acquire", {"version": None, "ttl": 5.0, "holder": ""}, "InvalidArgumentError"),
    ("renew", {"lease": Lease("x-1", 2, "h", 5.0, 1.0).to_dict()}, "LeaseNotFoundError"),
    ("renew", {"lease": {"id": ["x"]}}, "InvalidArgumentError"),
    ("release", {"lease": {"id": "x", "version": "2"}}, "InvalidArgumentError"),
    ("report_serving", {"replica": "", "version": 1}, "InvalidArgumentError"),
    ("get", {"version": 9}, "VersionNotFoundError"),
    ("wait_for_version", {"min_version": 99, "timeout": 0}, "VersionWaitTimeoutError"),
]


@FUZZ
@given(
    frames=st.lists(st.binary(max_size=300), min_size=1, max_size=3)
    | st.binary(max_size=300).map(seal)
    | json_values.map(lambda v: seal(json.dumps(v).encode()))
)
def test_random_bytes_get_an_error_reply(live, frames):
    expected = live.expect(frames)
    reply = live.throw(frames)
    assert not reply.ok and reply.error["type"] == expected
    assert reply.epoch == live.served.epoch
    live.unchanged()


@FUZZ
@given(data=st.data())
def test_a_wrong_envelope_gets_an_error_reply(live, data):
    op = data.draw(st.sampled_from(sorted(READS)))
    key = data.draw(st.sampled_from(["wp", "type", "id", "nonce", "ts", "epoch", "op", "args", "missing", "extra"]))
    body = envelope(live, op, READS[op])
    if key == "missing":
        del body[data.draw(st.sampled_from(sorted(body)))]
    elif key == "extra":
        body[data.draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in body))] = data.draw(json_values)
    else:
        body[key] = data.draw(json_values | st.text(min_size=16, max_size=40))
    frames = seal(json.dumps(body).encode())
    expected = live.expect(frames)
    reply = live.throw(frames)
    if expected is None:  # the change left it valid: a read, answered
        assert reply.ok or reply.error["type"] == "VersionWaitTimeoutError"
    else:
        assert not reply.ok and reply.error["type"] == expected, reply.error
    live.unchanged()


@FUZZ
@given(data=st.data())
def test_wrong_arguments_get_an_error_reply(live, data):
    op = data.draw(st.sampled_from(sorted(wire.OPS)))
    spec = wire.OPS[op]
    args = {name: data.draw(json_values) for name in spec.args}
    how = data.draw(st.sampled_from(["retype", "drop", "add"]))
    if how == "drop" and args:
        del args[data.draw(st.sampled_from(sorted(args)))]
    elif how == "add" or not args:
        args[data.draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in spec.args))] = data.draw(json_values)
    frames = seal(json.dumps(envelope(live, op, args)).encode())
    expected = live.expect(frames)
    assume(expected is not None or not spec.mutates)  # a valid mutation is no longer wrong
    reply = live.throw(frames)
    if expected is not None:
        assert not reply.ok and reply.error["type"] == expected, reply.error
    live.unchanged()


@FUZZ
@given(case=st.sampled_from(REFUSED))
def test_requests_the_registry_refuses_change_nothing(live, case):
    op, args, error = case
    frames = seal(json.dumps(envelope(live, op, args)).encode())
    assert live.expect(frames) is None  # well formed: the registry itself refuses it
    reply = live.throw(frames)
    assert not reply.ok and reply.error["type"] == error, reply.error
    live.unchanged()


@FUZZ
@given(op=st.sampled_from(sorted(READS)), age=st.floats(61, 1e9) | st.floats(-1e9, -61))
def test_replayed_and_stale_requests_are_refused(live, op, age):
    frames = wire.encode_request(SECRET, wire.Request(os.urandom(8).hex(), op, READS[op], live.served.epoch))
    assert live.expect(frames) is None
    first = live.throw(frames)
    assert first.ok or first.error["type"] == "VersionWaitTimeoutError"
    again = live.throw(frames)
    assert not again.ok and again.error["type"] == "ReplayedMessageError"
    stale = wire.Request(os.urandom(8).hex(), op, READS[op], live.served.epoch, ts=time.time() + age)
    reply = live.throw(wire.encode_request(SECRET, stale))
    assert not reply.ok and reply.error["type"] == "ReplayedMessageError" and "replay window" in reply.error["message"]
    live.unchanged()


def test_oversized_messages_are_refused_and_the_server_stays_up(live):
    reply = live.throw([os.urandom(wire.MAX_MESSAGE + 1)])
    assert not reply.ok and reply.error["type"] == "MessageTooLargeError"
    live.sock.send_multipart([os.urandom(8 * wire.MAX_MESSAGE)])  # past zmq's own limit: dropped unread
    live.unchanged()


def test_the_server_logged_what_it_refused_and_still_serves(live):
    assert live.served.log().count("refused a message") > 100
    live.unchanged()
    lease = Lease.from_dict(anyio.run(_acquire_release, live.served.address))
    assert lease.holder == "after-the-fuzz"


async def _acquire_release(address: str) -> dict:
    reg = ZmqRegistry(address, secret=SECRET, heartbeat=None)
    lease = await reg.acquire(ttl=5.0, holder="after-the-fuzz")
    await reg.release(lease)
    await reg.aclose()
    return lease.to_dict()

"""The served registry's wire protocol, without sockets."""

import json

import pytest

from weightpull import errors
from weightpull.errors import (
    AuthenticationError,
    InvalidArgumentError,
    InvalidTransitionError,
    MalformedMessageError,
    MessageTooLargeError,
    RegistryError,
    ReplayedMessageError,
    VersionOrderError,
    WeightpullError,
)
from weightpull.layout import TensorSpec, plan_layout
from weightpull.manifest import Manifest
from weightpull.registry import Lease, LeaseInfo, RegistryStatus, VersionInfo
from weightpull.states import LeaseEvent, LeaseState, VersionState

pytest.importorskip("zmq")
from weightpull.drivers.zmq_registry import wire  # noqa: E402

KEY = b"k"


def request(op="acquire", args=None, epoch="e1", **kw):
    return wire.Request("r1", op, {"version": None, "ttl": 5.0, "holder": "h"} if args is None else args, epoch, **kw)


def body(frames):
    return json.loads(frames[0][wire.MAC_BYTES :])


def seal(data, key=KEY):
    raw = json.dumps(data).encode()
    return [wire.mac(key, raw) + raw]


def test_request_and_reply_round_trip():
    req = request()
    assert wire.decode_request(KEY, wire.encode_request(KEY, req)) == req
    rep = wire.Reply(req.id, req.nonce, "e1", True, {"x": [1, 2]})
    assert wire.decode_reply(KEY, wire.encode_reply(KEY, rep)) == rep
    failure = wire.Reply.failure("e1", VersionOrderError("v3 <= v4"), id="r1", re=req.nonce)
    back = wire.decode_reply(KEY, wire.encode_reply(KEY, failure))
    assert not back.ok and back.error == {"type": "VersionOrderError", "message": "v3 <= v4"}


def test_a_retry_keeps_the_id_and_draws_a_fresh_nonce():
    req = request(epoch=None)
    again = req.retry("e2")
    assert again.id == req.id and again.op == req.op and again.args == req.args
    assert again.nonce != req.nonce and again.epoch == "e2" and again.ts >= req.ts


@pytest.mark.parametrize("part", ["mac", "body"])
def test_tampering_or_another_key_fails_the_mac(part):
    [frame] = wire.encode_request(KEY, request())
    i = 3 if part == "mac" else len(frame) - 3
    tampered = frame[:i] + bytes([frame[i] ^ 1]) + frame[i + 1 :]
    with pytest.raises(AuthenticationError):
        wire.decode_request(KEY, [tampered])
    with pytest.raises(AuthenticationError):
        wire.decode_request(b"other", [frame])
    with pytest.raises(AuthenticationError):  # no secret is a key too: the empty one
        wire.decode_reply(b"", wire.encode_reply(KEY, wire.Reply("r", None, "e", True)))


@pytest.mark.parametrize(
    "frames, error, words",
    [
        ([], MalformedMessageError, "expected 1 frame"),
        ([b"a", b"b"], MalformedMessageError, "expected 1 frame"),
        ([b"short"], MalformedMessageError, "shorter than"),
        ([b"x" * (wire.MAX_MESSAGE + 1)], MessageTooLargeError, "exceeds the limit"),
        (seal([1, 2]), MalformedMessageError, "must be a JSON object"),
        ([wire.mac(KEY, b'{"a": NaN}') + b'{"a": NaN}'], MalformedMessageError, "not JSON"),
        ([wire.mac(KEY, b"\xff\xfe") + b"\xff\xfe"], MalformedMessageError, "not JSON"),
        ([wire.mac(KEY, b"[" * 100_000) + b"[" * 100_000], MalformedMessageError, "not JSON"),
    ],
)
def test_broken_messages_are_refused_by_name(frames, error, words):
    with pytest.raises(error, match=words):
        wire.decode_request(KEY, frames)


def good_request_body():
    return body(wire.encode_request(KEY, request()))


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda b: b.pop("nonce"), "RequestBody.nonce is missing"),
        (lambda b: b.update(extra=1), "RequestBody has unexpected keys \\['extra'\\]"),
        (lambda b: b.update(wp=2), "protocol"),
        (lambda b: b.update(type="reply"), "protocol"),
        (lambda b: b.update(id=7), "RequestBody.id must be"),
        (lambda b: b.update(id="x" * 65), "RequestBody.id must be"),
        (lambda b: b.update(nonce="short"), "RequestBody.nonce must be"),
        (lambda b: b.update(ts="now"), "RequestBody.ts must be"),
        (lambda b: b.update(ts=True), "RequestBody.ts must be"),
        (lambda b: b.update(ts=10**400), "RequestBody.ts must be"),  # would overflow the replay window's float maths
        (lambda b: b.update(epoch=3), "RequestBody.epoch must be"),
        (lambda b: b.update(args=[]), "RequestBody.args must be"),
        (lambda b: b.update(op=None), "RequestBody.op must be"),
    ],
)
def test_a_wrong_envelope_is_refused_naming_the_field(change, words):
    b = good_request_body()
    change(b)
    with pytest.raises(MalformedMessageError, match=words):
        wire.decode_request(KEY, seal(b))


@pytest.mark.parametrize(
    "op, args, words",
    [
        ("drop_tables", {}, "unknown operation"),
        ("acquire", {"ttl": 5.0, "holder": "h"}, "AcquireArgs.version is missing"),
        ("status", {"verbose": True}, "StatusArgs has unexpected keys \\['verbose'\\]"),
        ("acquire", {"version": -1, "ttl": 5.0, "holder": "h"}, "version must be an int"),
        ("acquire", {"version": True, "ttl": 5.0, "holder": "h"}, "version must be an int"),
        ("acquire", {"version": None, "ttl": "5", "holder": "h"}, "ttl must be a number"),
        ("acquire", {"version": None, "ttl": 10**400, "holder": "h"}, "ttl must be a number of magnitude"),
        ("wait_for_version", {"min_version": 1, "timeout": -1e300}, "timeout must be a number"),
        ("begin", {"version": 2**63, "publisher": "p", "slot": 0}, "version must be"),
        ("begin", {"version": 1, "publisher": ["p"], "slot": 0}, "publisher must be a string"),
        ("renew", {"lease": "l-1"}, "lease must be an object"),
        ("keepalive", {"names": "trainer"}, "names must be a list of at most 1024 names"),
        ("keepalive", {"names": [1]}, "names\\[0\\] must be a string"),
        ("begin", {"version": "1", "publisher": "p", "slot": 0}, "version must be"),
    ],
)
def test_wrong_arguments_are_refused_naming_them(op, args, words):
    with pytest.raises(MalformedMessageError, match=words) as info:
        wire.check_args(request(op, args))
    assert isinstance(info.value, InvalidArgumentError)  # as an embedded registry's refusal is


def test_keepalive_and_a_numberless_begin_are_on_the_wire():
    assert wire.check_args(request("keepalive", {"names": ["trainer", "replica-0/rank1"]})) is wire.OPS["keepalive"]
    assert not wire.OPS["keepalive"].mutates
    wire.check_args(request("begin", {"version": None, "publisher": "p", "slot": 0}))  # the registry picks


def test_every_operation_of_the_registry_is_on_the_wire():
    from weightpull.registry import Registry, RelayingRegistry, ReservingRegistry, StreamingRegistry

    protocols = (Registry, StreamingRegistry, ReservingRegistry, RelayingRegistry)
    methods = {m for protocol in protocols for m in vars(protocol) if not m.startswith("_")}
    assert methods <= set(wire.OPS)
    assert {op for op, spec in wire.OPS.items() if spec.mutates} == {
        "begin",
        "commit",
        "abort",
        "retire",
        "reclaim",
        "acquire",
        "renew",
        "release",
        "release_checked",
        "report_serving",
        "stream",
        "mark",
        "commit_stream",
        "reserve",
        "offer",
        "mark_offer",
        "withdraw",
    }


def test_replay_window_accepts_each_nonce_once_and_only_in_time():
    window = wire.ReplayWindow(window=10.0)
    window.admit("n1", 100.0, now=100.0)
    with pytest.raises(ReplayedMessageError, match="already used"):
        window.admit("n1", 100.0, now=101.0)
    with pytest.raises(ReplayedMessageError, match="replay window"):
        window.admit("n2", 80.0, now=100.0)
    with pytest.raises(ReplayedMessageError, match="replay window"):
        window.admit("n3", 120.0, now=100.0)
    window.admit("n4", 105.0, now=100.0)  # a clock ahead within the window is fine
    window.admit("n5", 110.0, now=111.0)  # n1 aged out of memory, and its ts out of the window
    assert len(window) == 2
    with pytest.raises(ReplayedMessageError, match="replay window"):
        window.admit("n1", 100.0, now=111.0)


def test_replay_window_stays_bounded_and_refuses_what_it_forgot():
    window = wire.ReplayWindow(window=60.0, max_nonces=3)
    for i in range(5):
        window.admit(f"n{i}", 100.0 + i, now=105.0)
    assert len(window) == 3
    with pytest.raises(ReplayedMessageError, match="forget"):
        window.admit("n0", 100.0, now=105.0)  # forgotten, yet still refused
    with pytest.raises(ReplayedMessageError, match="forget"):
        window.admit("fresh", 101.0, now=105.0)  # as old as what was forgotten
    window.admit("fresh", 104.5, now=105.0)


def test_reply_cache_answers_a_retry_and_refuses_a_reused_id():
    cache = wire.ReplyCache(size=2)
    req = request()
    assert cache.get(req) is None
    cache.put(req, {"ok": True, "result": 1})
    assert cache.get(req.retry("e1")) == {"ok": True, "result": 1}
    with pytest.raises(MalformedMessageError, match="already used for a different request"):
        cache.get(request(args={"version": 3, "ttl": 5.0, "holder": "h"}))
    assert cache.get(req, "reader replica-0") is None  # one principal's ids are not another's
    cache.put(wire.Request("r2", "ping", {}, "e1"), {"ok": True})
    cache.put(wire.Request("r3", "ping", {}, "e1"), {"ok": True})
    assert len(cache) == 2 and cache.get(req) is None


def test_every_error_comes_back_as_its_own_type():
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, WeightpullError)]
    for cls in classes:
        try:
            exc = cls("what went wrong")
        except TypeError:  # built from fields, not a message: not a registry error
            continue
        back = wire.error_from_dict(wire.error_to_dict(exc))
        assert type(back) is cls and str(back) == "what went wrong"
    exc = InvalidTransitionError("lease", LeaseState.RELEASED, LeaseEvent.RENEW, "l-1")
    back = wire.error_from_dict(json.loads(json.dumps(wire.error_to_dict(exc))))
    assert type(back) is InvalidTransitionError and str(back) == str(exc)
    assert (back.state, back.event) == (LeaseState.RELEASED, LeaseEvent.RENEW)
    unknown = wire.error_from_dict({"type": "SystemExit", "message": "bye"})
    assert type(unknown) is RegistryError and "SystemExit: bye" in str(unknown)


def test_registry_types_cross_the_wire_and_are_checked():
    lease = Lease("abc-1", 3, "r0", 5.0, 12.5)
    assert Lease.from_dict(json.loads(json.dumps(lease.to_dict()))) == lease
    status = RegistryStatus(
        4,
        (
            VersionInfo(4, VersionState.READY, "t", 1, 256, 1.5, 1),
            VersionInfo(3, VersionState.ABORTED, "t", 0, None, 2.0, 0, "boom"),
        ),
        (LeaseInfo("abc-1", 4, "r0", 4.5),),
        {"r0": 3},
    )
    assert RegistryStatus.from_dict(json.loads(json.dumps(status.to_dict()))) == status
    for bad in [{**lease.to_dict(), "version": "3"}, {**lease.to_dict(), "ttl": True}, {"id": "x"}, [1], None]:
        with pytest.raises(InvalidArgumentError, match="malformed lease: Lease"):
            Lease.from_dict(bad)
    with pytest.raises(InvalidArgumentError, match="VersionInfo.state must be one of"):
        VersionInfo.from_dict({**status.versions[0].to_dict(), "state": "GONE"})


def test_manifests_fit_the_message_limit_with_room_to_spare():
    specs = [
        TensorSpec(f"model.layers.{i // 10}.mlp.part_{i % 10}.weight", "bfloat16", (4096, 1024)) for i in range(2000)
    ]
    layout = plan_layout(specs)
    manifest = Manifest(1, layout, "nixl", b"\0" * 4096, 0, "trainer", digests=["0" * 32] * len(layout.buckets))
    frames = wire.encode_request(KEY, wire.Request("r", "commit", {"manifest": manifest.to_dict()}, "e"))
    assert len(frames[0]) < wire.MAX_MESSAGE / 4


def test_secret_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(wire.SECRET_ENV, raising=False)
    assert wire.load_secret() is None
    monkeypatch.setenv(wire.SECRET_ENV, "from-env")
    assert wire.load_secret() == b"from-env"
    path = tmp_path / "secret"
    path.write_bytes(b"from-file\n")
    assert wire.load_secret(str(path)) == b"from-file"
    path.write_bytes(b"\n")
    with pytest.raises(InvalidArgumentError, match="is empty"):
        wire.load_secret(str(path))
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        wire.load_secret(str(tmp_path / "missing"))


def test_connect_registry_picks_by_address(monkeypatch):
    from weightpull.drivers.zmq_registry.client import ZmqRegistry
    from weightpull.registry import InProcessRegistry, connect_registry

    monkeypatch.delenv("WEIGHTPULL_REGISTRY", raising=False)
    assert isinstance(connect_registry(), InProcessRegistry)
    monkeypatch.setenv("WEIGHTPULL_REGISTRY", "tcp://127.0.0.1:5555")
    reg = connect_registry()
    assert isinstance(reg, ZmqRegistry) and reg.address == "tcp://127.0.0.1:5555"
    assert connect_registry("tcp://10.0.0.1:7000").address == "tcp://10.0.0.1:7000"
    with pytest.raises(InvalidArgumentError, match="tcp://HOST:PORT"):
        connect_registry("10.0.0.1:7000")


def test_only_loopback_is_loopback():
    from weightpull.drivers.zmq_registry.server import is_loopback

    assert all(
        map(
            is_loopback,
            ["tcp://127.0.0.1:1", "tcp://127.9.9.9:0", "tcp://[::1]:5", "tcp://localhost:5", "ipc:///tmp/x"],
        )
    )
    assert not any(
        map(is_loopback, ["tcp://0.0.0.0:1", "tcp://*:5", "tcp://10.1.2.3:5", "tcp://eth0:5", "tcp://example.com:5"])
    )

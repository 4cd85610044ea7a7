"""The served registry's wire protocol, sans-IO: framing, schema, HMAC, replay window.

A message is one ZeroMQ frame: the HMAC-SHA256 of the body under the shared secret (32
bytes), then the body, a JSON object. The body carries a nonce, a wall-clock timestamp and the server's run
epoch, so the MAC covers all three: the server accepts a request once, only inside its
replay window, and only in the run it was signed for. A reply echoes the nonce of the
request it answers, so a client accepts no reply but the one to what it just sent.

Nothing here opens a socket or reads a clock it was not handed: the server and client
feed frames in and take frames out, and the tests drive every rule without either.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import json
import math
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from weightpull import errors
from weightpull.errors import (
    AuthenticationError,
    InvalidArgumentError,
    InvalidTransitionError,
    MalformedMessageError,
    MessageTooLargeError,
    RegistryError,
    ReplayedMessageError,
    WeightpullError,
)
from weightpull.states import MACHINES

PROTOCOL = 1
MAC_BYTES = 32
MAX_MESSAGE = 1 << 20  # bytes per message: a manifest of thousands of tensors fits
REPLAY_WINDOW = 60.0  # seconds either side of the server's wall clock
EPOCH_MISMATCH = "EpochMismatch"  # the error that tells a client the server restarted
SECRET_ENV = "WEIGHTPULL_SECRET"

_REQUEST_KEYS = frozenset({"wp", "type", "id", "nonce", "ts", "epoch", "op", "args"})
_REPLY_KEYS = frozenset({"wp", "type", "id", "re", "nonce", "ts", "epoch", "ok", "result", "error"})
_MAX_ID = 64


def load_secret(path: str | None = None) -> bytes | None:
    """The shared secret: the file at `path` (trailing newline dropped), else
    `$WEIGHTPULL_SECRET`; None when neither gives one."""
    if path:
        try:
            with open(path, "rb") as f:
                secret = f.read().rstrip(b"\r\n")
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read the secret file {path!r}: {exc.strerror}") from None
        if not secret:
            raise InvalidArgumentError(f"the secret file {path!r} is empty")
        return secret
    return os.environ.get(SECRET_ENV, "").encode() or None


def mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


def new_nonce() -> str:
    return secrets.token_hex(16)


# -- messages --------------------------------------------------------------------------


@attrs.frozen
class Request:
    id: str  # the same on every retry, so the server answers a retried request once
    op: str
    args: dict[str, Any]
    epoch: str | None  # the server run it is meant for; None to learn it
    nonce: str = attrs.Factory(new_nonce)
    ts: float = attrs.Factory(time.time)

    def retry(self, epoch: str | None) -> Request:
        """The same request again: same id, fresh nonce and timestamp."""
        return attrs.evolve(self, epoch=epoch, nonce=new_nonce(), ts=time.time())


@attrs.frozen
class Reply:
    id: str | None  # the request's id, or None when a message was too broken to say
    re: str | None  # the nonce of the request it answers
    epoch: str  # the server's run
    ok: bool
    result: Any = None
    error: Mapping[str, Any] | None = None  # {"type", "message"[, "fields"]}
    nonce: str = attrs.Factory(new_nonce)
    ts: float = attrs.Factory(time.time)

    @classmethod
    def failure(cls, epoch: str, exc: WeightpullError | Mapping[str, Any], *, id: str | None, re: str | None) -> Reply:
        error = exc if isinstance(exc, Mapping) else error_to_dict(exc)
        return cls(id, re, epoch, False, error=error)

    @property
    def epoch_changed(self) -> bool:
        return not self.ok and self.error is not None and self.error.get("type") == EPOCH_MISMATCH


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(body: bytes) -> Any:
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise MalformedMessageError(f"body is not JSON: {exc}") from None


def _sealed(key: bytes, body: dict[str, Any]) -> list[bytes]:
    """The frames of a message: one, the MAC then the body."""
    data = _dumps(body)
    return [mac(key, data) + data]


def encode_request(key: bytes, req: Request) -> list[bytes]:
    return _sealed(key, {"wp": PROTOCOL, "type": "request", "id": req.id, "nonce": req.nonce, "ts": req.ts,
                         "epoch": req.epoch, "op": req.op, "args": req.args})


def encode_reply(key: bytes, rep: Reply) -> list[bytes]:
    return _sealed(key, {"wp": PROTOCOL, "type": "reply", "id": rep.id, "re": rep.re, "nonce": rep.nonce,
                         "ts": rep.ts, "epoch": rep.epoch, "ok": rep.ok, "result": rep.result,
                         "error": None if rep.error is None else dict(rep.error)})


def _open(key: bytes, frames: list[bytes], max_bytes: int) -> dict[str, Any]:
    """The body of a sealed message, once its framing, size and MAC check out."""
    if len(frames) != 1:
        raise MalformedMessageError(f"expected 1 frame (mac, body), got {len(frames)}")
    if len(frames[0]) > max_bytes:
        raise MessageTooLargeError(f"message of {len(frames[0])} bytes exceeds the limit of {max_bytes}")
    if len(frames[0]) < MAC_BYTES:
        raise MalformedMessageError(f"message of {len(frames[0])} bytes is shorter than its {MAC_BYTES}-byte mac")
    tag, body = frames[0][:MAC_BYTES], frames[0][MAC_BYTES:]
    if not hmac.compare_digest(tag, mac(key, body)):
        raise AuthenticationError("HMAC check failed: the sender's secret differs from ours")
    data = _loads(body)
    if not isinstance(data, dict):
        raise MalformedMessageError(f"body must be a JSON object, got {type(data).__name__}")
    return data


def _field(data: Mapping[str, Any], key: str, ok: Callable[[Any], bool], want: str) -> Any:
    value = data[key]
    if not ok(value):
        raise MalformedMessageError(f"field {key!r} must be {want}, got {_show(value)}")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _envelope(data: dict[str, Any], keys: frozenset[str], kind: str) -> None:
    if set(data) != keys:
        missing, extra = sorted(keys - set(data)), sorted(set(data) - keys)
        raise MalformedMessageError(f"{kind} fields wrong: missing {missing}, unexpected {extra}")
    if data["wp"] != PROTOCOL or data["type"] != kind:
        raise MalformedMessageError(
            f"expected a protocol {PROTOCOL} {kind}, got protocol {_show(data['wp'])} {_show(data['type'])}"
        )


def decode_request(key: bytes, frames: list[bytes], *, max_bytes: int = MAX_MESSAGE) -> Request:
    """A request, checked in order: framing, size, MAC, JSON, envelope. Its op and args
    are checked by `check_args`; its nonce and timestamp by a `ReplayWindow`."""
    data = _open(key, frames, max_bytes)
    _envelope(data, _REQUEST_KEYS, "request")
    return Request(
        id=_field(data, "id", _is_id, f"a string of 1 to {_MAX_ID} characters"),
        op=_field(data, "op", _is_name, "an operation name"),
        args=_field(data, "args", _is_dict, "an object"),
        epoch=_field(data, "epoch", _opt(_is_id), "a run epoch or null"),
        nonce=_field(data, "nonce", _is_nonce, "a string of 16 to 64 characters"),
        ts=_field(data, "ts", _is_number, "a number of seconds"),
    )


def decode_reply(key: bytes, frames: list[bytes], *, max_bytes: int = MAX_MESSAGE) -> Reply:
    data = _open(key, frames, max_bytes)
    _envelope(data, _REPLY_KEYS, "reply")
    ok = _field(data, "ok", lambda v: isinstance(v, bool), "a boolean")
    error = data["error"]
    if not ok and not (isinstance(error, dict) and _is_str(error.get("type")) and _is_str(error.get("message"))):
        raise MalformedMessageError(f"a failed reply must name its error, got {_show(error)}")
    return Reply(
        id=_field(data, "id", _opt(_is_id), "a request id or null"),
        re=_field(data, "re", _opt(_is_nonce), "a nonce or null"),
        epoch=_field(data, "epoch", _is_id, "a run epoch"),
        ok=ok,
        result=data["result"],
        error=error,
        nonce=_field(data, "nonce", _is_nonce, "a nonce"),
        ts=_field(data, "ts", _is_number, "a number of seconds"),
    )


def peek(frames: list[bytes], max_bytes: int = MAX_MESSAGE) -> tuple[str | None, str | None]:
    """(id, nonce) of a message that failed its checks, if it says, so the error reply
    can name the request it answers; (None, None) otherwise."""
    if len(frames) != 1 or len(frames[0]) > max_bytes:
        return None, None
    try:
        data = _loads(frames[0][MAC_BYTES:])
    except MalformedMessageError:
        return None, None
    if not isinstance(data, dict):
        return None, None
    msg_id, nonce = data.get("id"), data.get("nonce")
    return (msg_id if _is_id(msg_id) else None), (nonce if _is_nonce(nonce) else None)


# -- operations ------------------------------------------------------------------------


def _is_str(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= 4096


def _is_id(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= _MAX_ID


def _is_nonce(v: Any) -> bool:
    return isinstance(v, str) and 16 <= len(v) <= 64


def _is_name(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= 32


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _is_number(v: Any) -> bool:
    # Bounded, not just finite: an int of 400 digits would overflow float arithmetic.
    return isinstance(v, (int, float)) and not isinstance(v, bool) and -1e18 < v < 1e18


def _is_dict(v: Any) -> bool:
    return isinstance(v, dict)


def _opt(test: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or test(v)


def _is_shard(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(_is_int(x) for x in v) and v[0] < v[1]


@attrs.frozen
class Arg:
    test: Callable[[Any], bool]
    want: str


INT = Arg(_is_int, "an int in [0, 2**63)")
STR = Arg(_is_str, "a string of at most 4096 characters")
NUMBER = Arg(_is_number, "a number of magnitude below 1e18")
OBJECT = Arg(_is_dict, "an object")
OPT_INT = Arg(_opt(_is_int), "an int in [0, 2**63) or null")
OPT_NUMBER = Arg(_opt(_is_number), "a number of magnitude below 1e18, or null")
SHARD = Arg(_is_shard, "[index, count] with 0 <= index < count")


@attrs.frozen
class Op:
    args: Mapping[str, Arg]
    mutates: bool  # its outcome is cached by request id: a retry is answered, not re-run
    optional: Mapping[str, Arg] = attrs.Factory(dict)  # sent only when set: older peers never see them


OPS: Mapping[str, Op] = {
    "ping": Op({}, False),
    "begin": Op({"version": INT, "publisher": STR, "slot": INT}, True, {"shard": SHARD}),
    "commit": Op({"manifest": OBJECT}, True),
    "abort": Op({"version": INT, "reason": STR}, True, {"shard": SHARD}),
    "retire": Op({"version": INT}, True),
    "reclaim": Op({"version": INT}, True),
    "newest": Op({}, False),
    "get": Op({"version": INT}, False),
    "acquire": Op({"version": OPT_INT, "ttl": NUMBER, "holder": STR}, True),
    "renew": Op({"lease": OBJECT}, True),
    "release": Op({"lease": OBJECT}, True),
    "is_valid": Op({"lease": OBJECT}, False),
    "wait_for_version": Op({"min_version": INT, "timeout": OPT_NUMBER}, False),
    "report_serving": Op({"replica": STR, "version": INT}, True),
    "status": Op({}, False),
}


def check_args(req: Request) -> Op:
    """The request's operation, once it has every argument it needs, and no others than
    it takes, each of the right type."""
    op = OPS.get(req.op)
    if op is None:
        raise MalformedMessageError(f"unknown operation {_show(req.op)}")
    takes = {**op.args, **op.optional}
    if not set(op.args) <= set(req.args) <= set(takes):
        missing, extra = sorted(set(op.args) - set(req.args)), sorted(set(req.args) - set(takes))
        raise MalformedMessageError(f"{req.op}: missing arguments {missing}, unexpected {extra}")
    for name, arg in takes.items():
        if name in req.args and not arg.test(req.args[name]):
            raise MalformedMessageError(f"{req.op}: {name} must be {arg.want}, got {_show(req.args[name])}")
    return op


# -- errors across the wire -------------------------------------------------------------


def error_to_dict(exc: WeightpullError) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, InvalidTransitionError):
        out["fields"] = {"machine": exc.machine, "state": str(exc.state), "event": str(exc.event),
                         "subject": exc.subject}
    return out


def error_from_dict(data: Mapping[str, Any]) -> WeightpullError:
    """The server's error, as the same typed exception an embedded registry raises; a
    type this side does not know comes back as `RegistryError` naming it."""
    name, message = str(data.get("type")), str(data.get("message"))
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, WeightpullError)):
        return RegistryError(f"{name}: {message}")
    if cls is InvalidTransitionError:
        f = data.get("fields")
        if isinstance(f, dict) and all(_is_str(f.get(k)) for k in ("machine", "state", "event", "subject")):
            machine = f["machine"]
            state, event = f["state"], f["event"]
            if machine in MACHINES:  # back to the enums, where they name real members
                states, events, _ = MACHINES[machine]
                state = next((s for s in states if s.value == state), state)
                event = next((e for e in events if e.value == event), event)
            return InvalidTransitionError(machine, state, event, f["subject"])
        return RegistryError(f"{name}: {message}")
    for klass in cls.__mro__:  # the nearest class built from a message alone
        if issubclass(klass, WeightpullError):
            try:
                return klass(message)
            except TypeError:
                continue
    raise AssertionError("WeightpullError takes a message")


# -- server-side memory -----------------------------------------------------------------


class ReplayWindow:
    """Accepts each nonce once, and only while its timestamp lies within `window`
    seconds of the server's clock. Bounded: past `max_nonces`, the oldest are forgotten
    and the window's floor rises past them, so they stay refused."""

    def __init__(self, window: float = REPLAY_WINDOW, max_nonces: int = 1 << 20) -> None:
        self.window = window
        self.max_nonces = max_nonces
        self._seen: set[str] = set()
        self._by_age: list[tuple[float, str]] = []
        self._floor = -math.inf

    def admit(self, nonce: str, ts: float, now: float) -> None:
        while self._by_age and self._by_age[0][0] < now - self.window:
            self._seen.discard(heapq.heappop(self._by_age)[1])
        if abs(ts - now) > self.window:
            raise ReplayedMessageError(
                f"timestamp is {ts - now:+.1f} s from the server's clock; the replay window is ±{self.window:g} s"
            )
        if ts <= self._floor:
            raise ReplayedMessageError("timestamp predates nonces the server had to forget; send a fresh request")
        if nonce in self._seen:
            raise ReplayedMessageError(f"nonce {nonce[:12]}... was already used")
        self._seen.add(nonce)
        heapq.heappush(self._by_age, (ts, nonce))
        while len(self._by_age) > self.max_nonces:
            ts0, old = heapq.heappop(self._by_age)
            self._seen.discard(old)
            self._floor = max(self._floor, ts0)

    def __len__(self) -> int:
        return len(self._seen)


def fingerprint(req: Request) -> str:
    return hashlib.sha256(json.dumps([req.op, req.args], sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class ReplyCache:
    """The outcomes of recent mutating requests by request id, so a retry (same id,
    fresh nonce) gets the first outcome instead of running again."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._entries: OrderedDict[str, tuple[str, dict[str, Any]]] = OrderedDict()

    def get(self, req: Request) -> dict[str, Any] | None:
        entry = self._entries.get(req.id)
        if entry is None:
            return None
        if entry[0] != fingerprint(req):
            raise MalformedMessageError(f"request id {req.id} was already used for a different request")
        return entry[1]

    def put(self, req: Request, outcome: dict[str, Any]) -> None:
        self._entries[req.id] = (fingerprint(req), outcome)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

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
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs
from cattrs.gen import make_dict_unstructure_fn, override

from weightpull import errors, operations, schema
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
from weightpull.schema import show
from weightpull.states import MACHINES

T = TypeVar("T")

PROTOCOL = 1
MAC_BYTES = 32
MAX_MESSAGE = 1 << 20  # bytes per message: a manifest of thousands of tensors fits
REPLAY_WINDOW = 60.0  # seconds either side of the server's wall clock
EPOCH_MISMATCH = "EpochMismatch"  # the error that tells a client the server restarted
SECRET_ENV = "WEIGHTPULL_SECRET"

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


# -- the schema of a message ---------------------------------------------------------------
# Every value is bounded, not just typed: a hostile message must not overflow the replay
# window's float maths (an int of 400 digits) or make the server keep a huge string.

Id = schema.refined("Id", str, f"a string of 1 to {_MAX_ID} characters", lambda v: 0 < len(v) <= _MAX_ID)
Nonce = schema.refined("Nonce", str, "a string of 16 to 64 characters", lambda v: 16 <= len(v) <= 64)
OpName = schema.refined("OpName", str, "an operation name", lambda v: 0 < len(v) <= 32)
# The values of the operations' arguments: the table's (weightpull.operations).
Text, Count, Seconds, ShardArg, Object, Blob, Names = (
    operations.Text,
    operations.Count,
    operations.Seconds,
    operations.ShardArg,
    operations.Object,
    operations.Blob,
    operations.Names,
)


@attrs.frozen
class RequestBody:
    wp: int
    type: str
    id: Id  # the same on every retry
    nonce: Nonce
    ts: Seconds
    epoch: Id | None
    op: OpName
    args: Object


@attrs.frozen
class ErrorBody:
    type: Text  # the exception's class name
    message: Text
    fields: Object | None = None  # what an InvalidTransitionError is rebuilt from


@attrs.frozen
class ReplyBody:
    wp: int
    type: str
    id: Id | None
    re: Nonce | None
    nonce: Nonce
    ts: Seconds
    epoch: Id
    ok: bool
    result: Any
    error: ErrorBody | None


@attrs.frozen
class TransitionFields:
    machine: Text
    state: Text
    event: Text
    subject: Text


schema.converter.register_unstructure_hook(  # "fields" only when there are some, as ever
    ErrorBody, make_dict_unstructure_fn(ErrorBody, schema.converter, fields=override(omit_if_default=True))
)


def _as_is(value: Any) -> Any:
    return value


# A request's args and a reply's result are JSON values already (each record's `to_dict`):
# walked again, a model's manifest cost its sender ~2.5 ms per message on an H200's host.
schema.converter.register_unstructure_hook(
    RequestBody, make_dict_unstructure_fn(RequestBody, schema.converter, args=override(unstruct_hook=_as_is))
)
schema.converter.register_unstructure_hook(
    ReplyBody, make_dict_unstructure_fn(ReplyBody, schema.converter, result=override(unstruct_hook=_as_is))
)


def _body(data: dict[str, Any], form: type[T], kind: str) -> T:
    """A message body, once its protocol and kind match, as `form`, every field checked."""
    if data.get("wp") != PROTOCOL or data.get("type") != kind:
        raise MalformedMessageError(
            f"expected a protocol {PROTOCOL} {kind}, got protocol {show(data.get('wp'))} {show(data.get('type'))}"
        )
    return schema.structure(data, form, MalformedMessageError)


def encode_request(key: bytes, req: Request) -> list[bytes]:
    body = RequestBody(PROTOCOL, "request", req.id, req.nonce, req.ts, req.epoch, req.op, req.args)
    return _sealed(key, schema.unstructure(body))


def encode_reply(key: bytes, rep: Reply) -> list[bytes]:
    error = None if rep.error is None else ErrorBody(**rep.error)
    body = ReplyBody(PROTOCOL, "reply", rep.id, rep.re, rep.nonce, rep.ts, rep.epoch, rep.ok, rep.result, error)
    return _sealed(key, schema.unstructure(body))


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


def decode_request(key: bytes, frames: list[bytes], *, max_bytes: int = MAX_MESSAGE) -> Request:
    """A request, checked in order: framing, size, MAC, JSON, envelope. Its op and args
    are checked by `check_args`; its nonce and timestamp by a `ReplayWindow`."""
    body = _body(_open(key, frames, max_bytes), RequestBody, "request")
    return Request(id=body.id, op=body.op, args=body.args, epoch=body.epoch, nonce=body.nonce, ts=body.ts)


def decode_reply(key: bytes, frames: list[bytes], *, max_bytes: int = MAX_MESSAGE) -> Reply:
    body = _body(_open(key, frames, max_bytes), ReplyBody, "reply")
    if not body.ok and body.error is None:
        raise MalformedMessageError("a failed reply must name its error, got null")
    error = None if body.error is None else schema.unstructure(body.error)
    return Reply(body.id, body.re, body.epoch, body.ok, body.result, error, body.nonce, body.ts)


def _fits(value: Any, form: Any) -> Any:
    try:
        return schema.converter.structure(value, form)
    except schema.Refused:
        return None


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
    return _fits(data.get("id"), Id), _fits(data.get("nonce"), Nonce)


# -- operations ------------------------------------------------------------------------


@attrs.frozen
class Op:
    args: Mapping[str, Any]  # name -> type, each required
    mutates: bool  # its outcome is cached by request id: a retry is answered, not re-run
    optional: Mapping[str, Any] = attrs.Factory(dict)  # sent only when set: older peers never see them


def _wire_op(op: operations.Operation) -> Op:
    return Op({k: f.wire for k, f in op.args.items()}, op.mutates, {k: f.wire for k, f in op.optional.items()})


# Each operation's wire form, made from the table of operations.
OPS: Mapping[str, Op] = {name: _wire_op(op) for name, op in operations.OPERATIONS.items()}


def _args_form(name: str, op: Op) -> type:
    """The attrs class an operation's arguments must structure as. An optional argument
    defaults to None yet is not Optional: sent, it must be a value, never null."""
    fields = {k: attrs.field(type=t) for k, t in op.args.items()}
    fields |= {k: attrs.field(type=t, default=None) for k, t in op.optional.items()}
    return attrs.make_class("".join(w.title() for w in name.split("_")) + "Args", fields, frozen=True)


_ARGS = {name: _args_form(name, op) for name, op in OPS.items()}


def check_args(req: Request) -> Op:
    """The request's operation, once it has every argument it needs, and no others than
    it takes, each of the right type."""
    op = OPS.get(req.op)
    if op is None:
        raise MalformedMessageError(f"unknown operation {show(req.op)}")
    schema.structure(req.args, _ARGS[req.op], MalformedMessageError)
    return op


# -- errors across the wire -------------------------------------------------------------


def error_to_dict(exc: WeightpullError) -> dict[str, Any]:
    fields = None
    if isinstance(exc, InvalidTransitionError):
        fields = {"machine": exc.machine, "state": str(exc.state), "event": str(exc.event), "subject": exc.subject}
    return schema.unstructure(ErrorBody(type(exc).__name__, str(exc), fields))


def error_from_dict(data: Mapping[str, Any]) -> WeightpullError:
    """The server's error, as the same typed exception an embedded registry raises; a
    type this side does not know comes back as `RegistryError` naming it."""
    name, message = str(data.get("type")), str(data.get("message"))
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, WeightpullError)):
        return RegistryError(f"{name}: {message}")
    if cls is InvalidTransitionError:
        try:
            f = schema.structure(data.get("fields"), TransitionFields, MalformedMessageError)
        except MalformedMessageError:
            return RegistryError(f"{name}: {message}")
        state: Any = f.state
        event: Any = f.event
        if f.machine in MACHINES:  # back to the enums, where they name real members
            states, events, _ = MACHINES[f.machine]
            state = next((s for s in states if s.value == state), state)
            event = next((e for e in events if e.value == event), event)
        return InvalidTransitionError(f.machine, state, event, f.subject)
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
    fresh nonce) gets the first outcome instead of running again. Each principal (`who`)
    has its own ids: one never gets the outcome of another's request."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._entries: OrderedDict[tuple[str, str], tuple[str, dict[str, Any]]] = OrderedDict()

    def get(self, req: Request, who: str = "") -> dict[str, Any] | None:
        entry = self._entries.get((who, req.id))
        if entry is None:
            return None
        if entry[0] != fingerprint(req):
            raise MalformedMessageError(f"request id {req.id} was already used for a different request")
        return entry[1]

    def put(self, req: Request, outcome: dict[str, Any], who: str = "") -> None:
        self._entries[who, req.id] = (fingerprint(req), outcome)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

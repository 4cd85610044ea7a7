"""The registry's operations, in one table: what each takes, what it answers, who may
call it, whether it changes the registry, whether it waits.

Every face of a registry that is reached by messages is made from `OPERATIONS`: the
served registry's wire forms and dispatch (drivers/zmq_registry), its client's methods
(`OperationsClient`, which `ZmqRegistry` builds on) and the registry in a Ray actor
(drivers/ray_registry.py). Values cross as JSON: each argument and result has a `Form`
that turns the machine's values into JSON values and back, and names the schema type a
received value must structure as. An optional argument is sent only when set, so a peer
of an earlier release never sees one it does not know.

Adding an operation is one entry here plus its `RegistryMachine` method of the same name
and argument names (a long poll: its `InProcessRegistry` method), then a thin typed method
on `OperationsClient` (see docs/guides/registry-service.md).

The machine stays the authority: `callers` says who it lets in, for the docs and the
tests; `RegistryMachine` enforces it from the `by=` principal each call is made as.
Nothing here does I/O.
"""

from __future__ import annotations

import base64
import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from . import schema
from .errors import MalformedMessageError, ProtocolError
from .manifest import Manifest
from .principals import Principal
from .records import Lease, Progress, PullReport, RegistryStatus, Reservation

__all__ = ["OPERATIONS", "Callers", "Form", "Operation", "OperationsClient", "answer", "call", "execute"]

# -- the schema of a value ---------------------------------------------------------------
# Every value is bounded, not just typed: a hostile message must not make the registry
# keep a huge string or do maths on an int of 400 digits.

_TUPLE: Any = tuple  # indexed with the refined types at run time: mypy sees no type there
_LIST: Any = list
Text = schema.refined("Text", str, "a string of at most 4096 characters", lambda v: len(v) <= 4096)
Count = schema.refined("Count", int, "an int in [0, 2**63)", lambda v: 0 <= v < 2**63)
Seconds = schema.refined("Seconds", float, "a number of magnitude below 1e18", lambda v: -1e18 < v < 1e18)
ShardArg = schema.refined(
    "ShardArg", _TUPLE[Count, Count], "[index, count] with 0 <= index < count", lambda v: v[0] < v[1]
)
Object = dict[str, Any]
# A transport's descriptor of a relay's mirror, base64: agent metadata can run to kilobytes.
Blob = schema.refined("Blob", str, "base64 text of at most 1 MiB", lambda v: len(v) <= 1 << 20)
Names = schema.refined("Names", _LIST[Text], "a list of at most 1024 names", lambda v: len(v) <= 1024)


def _as_is(value: Any) -> Any:
    return value


def _nothing(_: Any) -> None:
    return None


def _unbase64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise MalformedMessageError("descriptor: not base64 text") from None


def _reservations(data: Any) -> tuple[Reservation, ...]:
    if not isinstance(data, list):
        raise ProtocolError(f"reservations: expected a list, got {type(data).__name__}")
    return tuple(Reservation.from_dict(r) for r in data)


def _optional(decode: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda data: None if data is None else decode(data)


@attrs.frozen
class Form:
    """How one value crosses as JSON: `to_json` on the way out, `from_json` on the way in,
    and `wire`, the schema type a received value must structure as."""

    wire: Any
    to_json: Callable[[Any], Any] = _as_is
    from_json: Callable[[Any], Any] = _as_is


COUNT = Form(Count)
MAYBE_COUNT = Form(Count | None)
TEXT = Form(Text)
SECONDS = Form(Seconds)
TIMEOUT = Form(Seconds | None)
FLAG = Form(bool, from_json=bool)
NAMES = Form(Names, to_json=list, from_json=tuple)
SHARD = Form(ShardArg, to_json=lambda s: [s[0], s[1]], from_json=lambda s: (s[0], s[1]))
DIGESTS = Form(_LIST[Text], to_json=list)
BLOB = Form(Blob, to_json=lambda b: base64.b64encode(b).decode(), from_json=_unbase64)
MANIFEST = Form(Object, to_json=Manifest.to_dict, from_json=Manifest.from_dict)
LEASE = Form(Object, to_json=Lease.to_dict, from_json=Lease.from_dict)
RESERVATION = Form(Object, to_json=Reservation.to_dict, from_json=Reservation.from_dict)
PULL = Form(Object, to_json=PullReport.to_dict, from_json=PullReport.from_dict)

# Results: each is JSON as the machine's value becomes it; the receiver rebuilds it.
PLAIN = Form(Any)  # None, or a number the caller reads as it is
INT = Form(Any, from_json=int)
BOOL = Form(Any, from_json=bool)
NOTHING = Form(Any, to_json=_nothing, from_json=_nothing)
MAYBE_MANIFEST = Form(Any, to_json=_optional(Manifest.to_dict), from_json=_optional(Manifest.from_dict))
LEASE_RESULT = Form(Any, to_json=Lease.to_dict, from_json=Lease.from_dict)
MANIFEST_RESULT = Form(Any, to_json=Manifest.to_dict, from_json=Manifest.from_dict)
PROGRESS = Form(Any, to_json=Progress.to_dict, from_json=Progress.from_dict)
STATUS = Form(Any, to_json=RegistryStatus.to_dict, from_json=RegistryStatus.from_dict)
RESERVATIONS = Form(Any, to_json=lambda rs: [r.to_dict() for r in rs], from_json=_reservations)
MAYBE_DIGESTS = Form(Any, to_json=_optional(list), from_json=_optional(tuple))


class Callers(enum.Enum):
    """Who the machine lets call an operation (an admin may always)."""

    ANYONE = "anyone"  # any principal: reads, and signs of life
    PUBLISHER = "publisher"  # a publisher, of versions under names it owns
    HOLDER = "holder"  # any principal, for holder and replica names it owns

    def __str__(self) -> str:
        return self.value


@attrs.frozen
class Operation:
    """One operation of the registry.

    Attributes:
        name: its name on the wire and its method's on every registry.
        args: each required argument's form, in the order a client passes them.
        result: the form of its answer.
        mutates: whether it changes the registry: a served registry answers a retry of it
            (same request id) from its reply cache instead of running it again.
        optional: arguments sent only when set (not None): a peer of an earlier release
            takes the request as ever.
        waits: a long poll, answered by the `InProcessRegistry` around the machine
            (bounded by the server), not by one synchronous machine call.
        method: the machine's (or, for a long poll, the `InProcessRegistry`'s) method,
            when it is not `name`.
        callers: who the machine lets call it.
    """

    name: str
    args: Mapping[str, Form]
    result: Form
    mutates: bool
    optional: Mapping[str, Form] = attrs.Factory(dict)
    waits: bool = False
    method: str = ""
    callers: Callers = Callers.ANYONE

    @property
    def forms(self) -> Mapping[str, Form]:
        return {**self.args, **self.optional}

    @property
    def target(self) -> str:
        """The method that runs it."""
        return self.method or self.name

    def encode_args(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The request's arguments as JSON values, in the order given; an optional one
        left out when None (as an earlier release sends it)."""
        out: dict[str, Any] = {}
        for name, value in values.items():
            if name in self.optional:
                if value is not None:
                    out[name] = self.optional[name].to_json(value)
            elif name in self.args:
                out[name] = value if value is None else self.args[name].to_json(value)
            else:
                raise TypeError(f"{self.name}() takes no argument {name!r}")
        if missing := [n for n in self.args if n not in out]:
            raise TypeError(f"{self.name}() needs {', '.join(missing)}")
        return out

    def decode_args(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments of its method from a checked request's arguments; an
        optional one not sent is left to the method's default."""
        forms = self.forms
        return {k: v if v is None else forms[k].from_json(v) for k, v in args.items() if k in forms}

    def encode_result(self, value: Any) -> Any:
        return self.result.to_json(value)

    def decode_result(self, data: Any) -> Any:
        return self.result.from_json(data)


def _op(
    name: str,
    args: Mapping[str, Form],
    result: Form = PLAIN,
    *,
    mutates: bool = False,
    optional: Mapping[str, Form] | None = None,
    **kw: Any,
) -> tuple[str, Operation]:
    return name, Operation(name, args, result, mutates, optional or {}, **kw)


_P, _H = Callers.PUBLISHER, Callers.HOLDER
OPERATIONS: Mapping[str, Operation] = dict(
    [
        _op("ping", {}, method="keepalive"),  # a sign of life, as every request is
        _op("keepalive", {"names": NAMES}),
        _op(
            "begin",
            {"version": MAYBE_COUNT, "publisher": TEXT, "slot": COUNT},
            mutates=True,
            optional={"shard": SHARD},
            callers=_P,
        ),
        _op("commit", {"manifest": MANIFEST}, mutates=True, callers=_P),
        _op("abort", {"version": COUNT, "reason": TEXT}, mutates=True, optional={"shard": SHARD}, callers=_P),
        _op("retire", {"version": COUNT}, mutates=True, callers=_P),
        _op("reclaim", {"version": COUNT}, mutates=True, callers=_P),
        _op("newest", {}, MAYBE_MANIFEST, optional={"publisher": TEXT}),
        _op("get", {"version": COUNT}, MANIFEST_RESULT),
        _op(
            "acquire",
            {"version": MAYBE_COUNT, "ttl": SECONDS, "holder": TEXT},
            LEASE_RESULT,
            mutates=True,
            optional={"streaming": FLAG, "host": TEXT, "exclude": NAMES, "publisher": TEXT, "part": TEXT},
            callers=_H,
        ),
        _op(
            "offer",
            {"version": COUNT, "holder": TEXT, "host": TEXT, "descriptor": BLOB},
            mutates=True,
            optional={"cap": COUNT, "landed": COUNT, "part": TEXT, "digests": DIGESTS},
            callers=_H,
        ),
        _op("part_digests", {"version": COUNT, "part": TEXT}, MAYBE_DIGESTS),
        _op("mark_offer", {"version": COUNT, "landed": COUNT, "holder": TEXT}, mutates=True, callers=_H),
        _op("withdraw", {"version": COUNT, "holder": TEXT}, mutates=True, callers=_H),
        _op("readers_at", {"version": COUNT, "holder": TEXT}, INT, callers=_H),
        _op("stream", {"manifest": MANIFEST}, mutates=True, callers=_P),
        _op("mark", {"version": COUNT, "committed": COUNT}, mutates=True, callers=_P),
        _op("commit_stream", {"version": COUNT}, mutates=True, optional={"digests": DIGESTS}, callers=_P),
        _op("progress", {"version": COUNT}, PROGRESS, optional={"source": TEXT}),
        _op("reserve", {"reservation": RESERVATION}, mutates=True, callers=_P),
        _op("reservations", {}, RESERVATIONS),
        _op(
            "wait_for_buckets",
            {"version": COUNT, "at_least": COUNT, "timeout": TIMEOUT},
            PROGRESS,
            optional={"source": TEXT, "publisher": TEXT},
            waits=True,
        ),
        _op("renew", {"lease": LEASE}, LEASE_RESULT, mutates=True, callers=_H),
        _op("release", {"lease": LEASE}, NOTHING, mutates=True, callers=_H),
        _op("release_checked", {"lease": LEASE}, BOOL, mutates=True, method="release", callers=_H),
        _op("is_valid", {"lease": LEASE}, BOOL, callers=_H),
        _op(
            "wait_for_version",
            {"min_version": COUNT, "timeout": TIMEOUT},
            MANIFEST_RESULT,
            optional={"publisher": TEXT},
            waits=True,
        ),
        _op(
            "report_serving",
            {"replica": TEXT, "version": COUNT},
            mutates=True,
            optional={"pull": PULL},
            callers=_H,
        ),
        _op("status", {}, STATUS),
    ]
)


# -- answering ---------------------------------------------------------------------------


def call(machine: Any, name: str, values: Mapping[str, Any], *, by: Principal) -> Any:
    """Run operation `name` (not a long poll) on `machine` (a `RegistryMachine`) as `by`,
    with the machine's own values (nothing crosses): an optional one that is None is
    left to the method's default."""
    op = OPERATIONS[name]
    assert not op.waits, f"{name} waits: answer it with `answer`"
    kwargs = {k: v for k, v in values.items() if v is not None or k not in op.optional}
    result = getattr(machine, op.target)(**kwargs, by=by)
    return None if op.result is NOTHING else result


def execute(machine: Any, name: str, args: Mapping[str, Any], *, by: Principal) -> Any:
    """Run one checked request (not a long poll) on `machine` (a `RegistryMachine`) as
    `by`, in one synchronous call; its result as JSON values."""
    op = OPERATIONS[name]
    return op.encode_result(call(machine, name, op.decode_args(args), by=by))


async def answer(registry: Any, name: str, args: Mapping[str, Any], *, by: Principal, max_wait: float | None) -> Any:
    """The result of one checked request as JSON values: a long poll waits on `registry`
    (an `InProcessRegistry`) at most `max_wait` seconds (None: as long as it asks), any
    other is `execute`d on its machine."""
    op = OPERATIONS[name]
    if not op.waits:
        return execute(registry.machine, name, args, by=by)
    registry.machine.keepalive((), by=by)  # a reader waiting is alive
    kwargs = op.decode_args(args)
    timeout = kwargs.get("timeout")
    if max_wait is not None:
        kwargs["timeout"] = max_wait if timeout is None else min(timeout, max_wait)
    return op.encode_result(await getattr(registry, op.target)(**kwargs))


# -- the client's face -------------------------------------------------------------------


class OperationsClient:
    """The typed methods of every operation: each hands its arguments to `_op`, which
    for a registry reached by messages encodes them by the table, hands them to `_send`,
    and decodes the answer. A subclass gives `_send` (one request, its JSON result), or
    `_op` itself (the in-process registry calls its machine), and may override a method
    to keep what it must remember (a served client's journal for a restart)."""

    async def _send(self, name: str, args: dict[str, Any]) -> Any:
        """Ask the registry `name` with `args` (JSON values); its result as JSON values,
        or its error raised as the same type."""
        raise NotImplementedError

    async def _op(self, name: str, **values: Any) -> Any:
        op = OPERATIONS[name]
        return op.decode_result(await self._send(name, op.encode_args(values)))

    async def _poll(self, name: str, timeout: float | None, **values: Any) -> Any:
        """A long poll: `name`, answered once it may be or after `timeout`."""
        return await self._op(name, timeout=timeout, **values)

    async def _stand_by(self, name: str) -> None:
        """After a begin, report or offer that named `name` (a publisher, replica or
        relay): a client with a heartbeat keeps it alive from then on."""

    # -- publishing --------------------------------------------------------------------

    async def begin(
        self, version: int | None = None, *, publisher: str, slot: int, shard: tuple[int, int] | None = None
    ) -> int:
        """Begin a version; the number the registry gave it (the one asked for while free)."""
        number: int = await self._op("begin", version=version, publisher=publisher, slot=slot, shard=shard)
        await self._stand_by(publisher)
        return number

    async def commit(self, manifest: Manifest) -> None:
        """WRITING -> READY (a shard's part, for a sharded version); the line's previous newest READY retires."""
        await self._op("commit", manifest=manifest)

    async def abort(self, version: int, reason: str = "", *, shard: tuple[int, int] | None = None) -> None:
        """Give up a version being written (one shard's part, with `shard`), saying why."""
        await self._op("abort", version=version, reason=reason, shard=shard)

    async def retire(self, version: int) -> None:
        """Withdraw a READY version: no new leases; those held stay valid."""
        await self._op("retire", version=version)

    async def reclaim(self, version: int) -> None:
        """Give a RETIRED or ABORTED version's slot back to its publisher, once no lease on it lives."""
        await self._op("reclaim", version=version)

    async def reserve(self, reservation: Reservation) -> None:
        """Register a publisher's slots ahead of its first version."""
        await self._op("reserve", reservation=reservation)

    async def stream(self, manifest: Manifest) -> None:
        """WRITING -> STREAMING: the version's manifest, so that readers may read it as it is written."""
        await self._op("stream", manifest=manifest)

    async def mark(self, version: int, committed: int) -> None:
        """Of a STREAMING version, the first `committed` buckets may be read."""
        await self._op("mark", version=version, committed=committed)

    async def commit_stream(self, version: int, digests: Sequence[str] | None = None) -> None:
        """STREAMING -> READY, with the buckets' digests if any."""
        await self._op("commit_stream", version=version, digests=digests)

    # -- reading -----------------------------------------------------------------------

    async def newest(self, *, publisher: str | None = None) -> Manifest | None:
        """The newest READY manifest of `publisher`'s line (None: the default line), or None."""
        found: Manifest | None = await self._op("newest", publisher=publisher)
        return found

    async def get(self, version: int) -> Manifest:
        """The manifest of `version`."""
        manifest: Manifest = await self._op("get", version=version)
        return manifest

    async def acquire(
        self,
        version: int | None = None,
        *,
        ttl: float,
        holder: str,
        streaming: bool = False,
        host: str | None = None,
        exclude: Iterable[str] = (),
        publisher: str | None = None,
        part: str | None = None,
    ) -> Lease:
        """Lease `version` (None: the line's newest READY; with `streaming`, a STREAMING one
        too), placed at a source (the version's slot or a relay) when `host` is given: of
        slice layout `part`, if named."""
        # Each sent only when set, `exclude` only with a host: an older registry takes the rest.
        lease: Lease = await self._op(
            "acquire",
            version=version,
            ttl=ttl,
            holder=holder,
            streaming=streaming or None,
            host=host,
            exclude=None if host is None else exclude,
            publisher=publisher,
            part=part,
        )
        return lease

    async def renew(self, lease: Lease) -> Lease:
        """The lease, valid for another TTL from now on the registry's clock."""
        renewed: Lease = await self._op("renew", lease=lease)
        return renewed

    async def release(self, lease: Lease) -> None:
        """End a lease."""
        await self._op("release", lease=lease)

    async def release_checked(self, lease: Lease) -> bool | None:
        """End a lease, and say whether it held until then (one round trip for `is_valid`
        then `release`)."""
        held: bool = await self._op("release_checked", lease=lease)
        return held

    async def is_valid(self, lease: Lease) -> bool:
        """Whether the lease still holds."""
        valid: bool = await self._op("is_valid", lease=lease)
        return valid

    async def progress(self, version: int, *, source: str | None = None) -> Progress:
        """How many of the version's buckets may be read now (from relay `source`'s mirror, if named)."""
        progress: Progress = await self._op("progress", version=version, source=source or None)
        return progress

    async def reservations(self) -> tuple[Reservation, ...]:
        """Every publisher's reservation."""
        found: tuple[Reservation, ...] = await self._op("reservations")
        return found

    async def wait_for_version(
        self, min_version: int, timeout: float | None = None, *, publisher: str | None = None
    ) -> Manifest:
        """The newest READY manifest of `publisher`'s line (None: the default line) once
        its version is at least `min_version`; `VersionWaitTimeoutError` after `timeout`."""
        manifest: Manifest = await self._poll("wait_for_version", timeout, min_version=min_version, publisher=publisher)
        return manifest

    async def wait_for_buckets(
        self,
        version: int,
        at_least: int,
        timeout: float | None = None,
        *,
        source: str | None = None,
        publisher: str | None = None,
    ) -> Progress:
        """The version's progress once `at_least` of its buckets may be read (from relay
        `source`'s mirror, if named); `VersionWaitTimeoutError` after `timeout`."""
        progress: Progress = await self._poll(
            "wait_for_buckets", timeout, version=version, at_least=at_least, source=source or None, publisher=publisher
        )
        return progress

    # -- relays ------------------------------------------------------------------------

    async def offer(
        self,
        version: int,
        *,
        holder: str,
        host: str,
        descriptor: bytes,
        cap: int | None = None,
        landed: int | None = None,
        part: str | None = None,
        digests: Sequence[str] | None = None,
    ) -> None:
        """Offer the version `holder`'s mirror holds (its first `landed` buckets; of slice
        layout `part`, vouched for by `digests`, if named) as a relay."""
        await self._op(
            "offer",
            version=version,
            holder=holder,
            host=host,
            descriptor=descriptor,
            cap=cap,
            landed=landed,
            part=part,
            digests=digests,
        )
        await self._stand_by(holder)

    async def part_digests(self, version: int, part: str) -> tuple[str, ...] | None:
        """The digests of slice layout `part` of `version`, as recorded by its first relay
        that read it from the version's slot; None while none did."""
        found: tuple[str, ...] | None = await self._op("part_digests", version=version, part=part)
        return found

    async def mark_offer(self, version: int, landed: int, *, holder: str) -> None:
        """A relay's mirror now holds the version's first `landed` buckets."""
        await self._op("mark_offer", version=version, landed=landed, holder=holder)

    async def withdraw(self, version: int, *, holder: str) -> None:
        """A relay stops offering the version."""
        await self._op("withdraw", version=version, holder=holder)

    async def readers_at(self, version: int, holder: str) -> int:
        """How many live leases read the version from relay `holder`."""
        count: int = await self._op("readers_at", version=version, holder=holder)
        return count

    # -- replicas and status -----------------------------------------------------------

    async def report_serving(self, replica: str, version: int, *, pull: PullReport | None = None) -> None:
        """Replica `replica` serves `version` now; with `pull`, how its pull went (the status shows it)."""
        await self._op("report_serving", replica=replica, version=version, pull=pull)
        await self._stand_by(replica)

    async def keepalive(self, names: tuple[str, ...] = ()) -> None:
        """Renew this principal's liveness, and that of the names given (its own)."""
        await self._op("keepalive", names=names)

    async def status(self) -> RegistryStatus:
        """Every version, lease, serving replica, live principal and offer."""
        status: RegistryStatus = await self._op("status")
        return status

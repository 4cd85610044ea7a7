"""The served registry's client: the `Registry` interface over ZeroMQ (asyncio only, as
pyzmq's async sockets are).

Each call is one request on a DEALER socket of a small pool, one socket per call in
flight, so concurrent calls never wait on each other's replies. An attempt that gets no
reply within `timeout` closes its socket (so a late reply cannot reach the next call)
and is sent again on a fresh one: same request id, fresh nonce; the server answers a
retried request from its reply cache rather than running it twice. After `retry_for`
seconds without an answer the call raises `RegistryUnavailableError`; until the server
has answered once, after `connect_timeout` seconds (5): an address where nothing
listens is told within seconds, not after the retries meant for a restart, and the
error asks whether `weightpull registry serve` runs there.

Restart: the server keeps no state across runs, and every reply names its run epoch.
On a new one this client replays what it told the old run and still stands by (each
publisher's newest committed version, versions begun and not yet ended, what each
replica serves), then resends the call. Leases are not replayed: the new run knows none,
so a read under one fails its final check as torn and the puller retries; nor are relays'
offers (a relay offers again at its next pull). A client that publishes, reports serving
or offers a relay sends a heartbeat (`keepalive`, naming the publisher, replica and relay
names it stands by), which keeps them alive at the registry and makes the replay
happen within about a second of a restart even while the trainer is between publishes.

Who it is: with a key (`key=`, else `$WEIGHTPULL_KEY`: its secret certificate, and
`server_key=`, else `$WEIGHTPULL_SERVER_KEY`: the server's public one, never a secret
one) it speaks CURVE and acts as the principal its certificate names (`.principal`); a
key's errors name the variable its path came from. A reader key for a prefix
(`rollout-*`) acts under the name `name=` gives (else `$WEIGHTPULL_NAME`, else the
prefix and 8 random hex digits), which must extend the prefix: `.principal` is then
`reader rollout-7`, and its pullers' holder names go below it. Without one it speaks
plainly to a development server, as admin; `secret=` (or `$WEIGHTPULL_SECRET`) is the
deprecated HMAC mode, as admin too. A handshake the server refuses is silent in ZeroMQ:
each new socket watches its monitor until its handshake succeeds, and a failure raises
`AuthenticationError` naming the likely cause instead of waiting out the retries.

Lifecycle: `async with ZmqRegistry(...)` (or `connect_registry(address)`) runs the
heartbeat in a task group of the block, so it ends with the block. Used without `async
with`, the heartbeat is a task of the event loop that `aclose` or the loop's end stops.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import uuid
import warnings
from collections.abc import Sequence
from typing import Any, Self

import anyio
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from weightpull import operations
from weightpull.errors import (
    AuthenticationError,
    InvalidArgumentError,
    MalformedMessageError,
    MessageTooLargeError,
    PublisherLapsedError,
    RegistryError,
    RegistryUnavailableError,
    VersionNotFoundError,
    VersionWaitTimeoutError,
)
from weightpull.manifest import Manifest
from weightpull.operations import OperationsClient
from weightpull.principals import ADMIN, Principal
from weightpull.records import Lease, PullReport
from weightpull.tasks import close_owned

from . import keys as keyfiles
from . import wire

log = logging.getLogger("weightpull.registry.client")
_MAX_ABORTED = 16  # a shard's aborts kept for replay: older versions' parts are reclaimed by then


def _shard(shard: tuple[int, int] | None) -> dict[str, Any]:
    """The optional `shard` argument, sent only when set: to an older server, a request
    without it is the same as ever."""
    return {} if shard is None else {"shard": [shard[0], shard[1]]}


_NO_DETAIL_LIMIT = 2  # handshakes failed without detail before the server key is blamed
# The deadline of the call an attempt belongs to, on the loop's clock: a handshake not done by
# then ends the attempt (a context variable, so that `_exchange` keeps its signature for subclasses).
_HANDSHAKE_BY: contextvars.ContextVar[float | None] = contextvars.ContextVar("_HANDSHAKE_BY", default=None)
DEFAULT_CONNECT_TIMEOUT = 5.0  # seconds the first call waits for a server that never answered
UNREACHABLE_HINT = (
    "is `weightpull registry serve` running there? Start it, or pass --registry ADDRESS or set "
    "$WEIGHTPULL_REGISTRY to reach another one (in code, connect_registry(ADDRESS))"
)


class _Conn:
    """A DEALER socket of the pool, and while its handshake has not succeeded yet, the
    monitor that tells whether it failed."""

    __slots__ = ("failed", "monitor", "sock")

    def __init__(self, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket | None) -> None:
        self.sock, self.monitor, self.failed = sock, monitor, 0

    def unwatch(self) -> None:
        if self.monitor is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.monitor.close(linger=0)
            self.monitor = None

    def close(self) -> None:
        self.unwatch()
        self.sock.close(linger=0)


class _NewRun(Exception):
    """The server moved to another run while this client replayed into one."""

    def __init__(self, epoch: str) -> None:
        self.epoch = epoch


class ZmqRegistry(OperationsClient):
    """A client of `weightpull registry serve`, interchangeable with `InProcessRegistry`."""

    def __init__(
        self,
        address: str,
        *,
        key: str | os.PathLike[str] | None = None,
        server_key: str | os.PathLike[str] | None = None,
        secret: bytes | str | None = None,
        timeout: float = 2.0,
        retry_for: float = 30.0,
        wait_poll: float = 10.0,
        heartbeat: float | None = 1.0,
        max_message: int = wire.MAX_MESSAGE,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
        name: str | None = None,
    ) -> None:
        """`connect_timeout`: how long a call waits for a server that has not answered this
        client yet before `RegistryUnavailableError` (None: `retry_for`, as for a server
        that answered before; pass a longer one where clients start before their server).
        `name`: the name a prefix key (`reader rollout-*`) acts under (default
        `$WEIGHTPULL_NAME`, else the prefix and 8 random hex digits)."""
        if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://", "inproc://")):
            raise InvalidArgumentError(f"a registry address looks like tcp://HOST:PORT, got {address!r}")
        if timeout <= 0 or retry_for < 0 or wait_poll <= 0 or (connect_timeout is not None and connect_timeout <= 0):
            raise InvalidArgumentError(
                "timeout, wait_poll and connect_timeout must be positive (connect_timeout None: retry_for), "
                "retry_for non-negative"
            )
        self.address = address
        self._cert: keyfiles.Certificate | None = None
        self._server: keyfiles.Certificate | None = None
        self._key_source: str | None = None  # where the key's path came from, when not key=
        if key is None and secret is None:
            key = os.environ.get(keyfiles.KEY_ENV) or None
            self._key_source = f"${keyfiles.KEY_ENV}" if key is not None else None
            secret = None if key is not None else wire.load_secret()
        if key is not None and secret is not None:
            raise InvalidArgumentError("pass a key or a secret (deprecated), not both")
        if key is not None:
            self._cert = keyfiles.load_secret_cert(key, source=self._key_source)
            if self._cert.role == "server":
                raise InvalidArgumentError(
                    f"{keyfiles.named(self._cert.path, self._key_source)} is the server's own key, not a client's: "
                    "pass this client's NAME.key_secret (`weightpull keys new --role reader|publisher|admin`)"
                )
            server_source = None
            if not server_key:
                server_key = os.environ.get(keyfiles.SERVER_KEY_ENV) or None
                server_source = f"${keyfiles.SERVER_KEY_ENV}"
            if server_key is None:
                raise InvalidArgumentError(
                    f"a client with a key also needs the server's public key: pass server_key= (--server-key) "
                    f"or set ${keyfiles.SERVER_KEY_ENV} to the server's .key file"
                )
            self._server = keyfiles.load_public_cert(server_key, source=server_source)
            if self._server.role != "server":
                raise InvalidArgumentError(
                    f"{keyfiles.named(self._server.path, server_source)} is the key of {self._server.role} "
                    f"{self._server.name}, not a server's: pass the public .key file of the pair "
                    "`registry serve --server-key` was given"
                )
        elif secret:
            warnings.warn(
                "a shared secret (secret=, $WEIGHTPULL_SECRET, --secret-file) is deprecated and goes in a later "
                "release: give this client a key (`weightpull keys new`; key=, $WEIGHTPULL_KEY)",
                DeprecationWarning,
                stacklevel=2,
            )
        self._key = b"" if secret is None else secret.encode() if isinstance(secret, str) else secret
        # Who this client acts as: its certificate's principal (for a prefix, the name it
        # picked under it); without a key, an admin.
        self.key_principal: Principal = self._cert.principal if self._cert is not None else ADMIN
        self.principal: Principal = self._acting_as(name)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.retry_for = retry_for
        self.wait_poll = wait_poll
        self.heartbeat = heartbeat
        self.max_message = max_message
        self.epoch: str | None = None  # the server run this client last spoke with
        # What this client told the registry and stands by, replayed into a new run.
        self._committed: dict[str, Manifest] = {}  # publisher -> its newest committed
        # A shard cannot tell whether its version turned READY, so each part stays until
        # its slot is reclaimed; and a shard's abort stays, to refuse its siblings' parts.
        self._parts: dict[tuple[int, str], Manifest] = {}  # (version, publisher) -> its shard's commit
        self._aborted: dict[int, tuple[str, tuple[int, int]]] = {}  # version -> (reason, shard), the last few
        # (version, publisher) -> (slot, shard): shard publishers of one version may share a client
        self._writing: dict[tuple[int, str], tuple[int, tuple[int, int] | None]] = {}
        self._serving: dict[str, int] = {}
        self._relaying: dict[str, set[int]] = {}  # a relay's holder name -> the versions it offers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: list[_Conn] = []
        self._adopting: anyio.Lock | None = None
        self._tasks: anyio.abc.TaskGroup | None = None  # inside `async with`: runs the heartbeat
        self._beat: anyio.CancelScope | None = None  # the running heartbeat's, to stop it
        self._loose: asyncio.Task[None] | None = None  # a heartbeat outside `async with` (the loop holds tasks weakly)
        self._keepalive = True  # False once a server of an earlier release said it has no such op
        self._release_checked = True  # likewise
        self._pull_reports = True  # likewise: whether the server takes report_serving's pull

    def __repr__(self) -> str:
        return f"ZmqRegistry({self.address!r}, run={self.epoch})"

    def _acting_as(self, name: str | None) -> Principal:
        """The principal this client acts as: its key's, or under a prefix key, the
        concrete name given (or `$WEIGHTPULL_NAME`, or a fresh one) that the prefix owns."""
        key = self.key_principal
        source = "name="
        if name is None and key.is_prefix:
            name, source = os.environ.get(keyfiles.NAME_ENV) or None, f"${keyfiles.NAME_ENV}"
        if name is None:
            return Principal(key.role, key.name[:-1] + uuid.uuid4().hex[:8]) if key.is_prefix else key
        if self._cert is None:
            raise InvalidArgumentError(
                f"{source} {name!r} picks the name a prefix key acts under, and this client has no key"
            )
        if key.is_prefix and key.owns(name) and "/" not in name:
            return Principal(key.role, name)
        if not key.is_prefix and name == key.name:
            return key
        raise InvalidArgumentError(
            f"{source} {name!r} is not a name the key of {key} ({keyfiles.named(self._cert.path, self._key_source)}) "
            + (
                f"may act under: it must be the prefix {key.name[:-1]!r} then at least one letter, digit, '.', "
                "'_' or '-' (as in " + repr(key.name[:-1] + "7") + ")"
                if key.is_prefix
                else "acts as: drop it, or use a key for that name"
            )
        )

    # -- publishing ----------------------------------------------------------------------

    async def begin(
        self, version: int | None = None, *, publisher: str, slot: int, shard: tuple[int, int] | None = None
    ) -> int:
        """Begin a version; the number the registry gave it (the one asked for while free)."""
        number = await self._op("begin", version=version, publisher=publisher, slot=slot, shard=shard)
        if not isinstance(number, int) or isinstance(number, bool):  # a server of an earlier release
            if version is None:
                raise MalformedMessageError("the registry did not say which number it gave the version")
            number = version
        self._writing[number, publisher] = (slot, shard)
        self._start_heartbeat()
        return number

    async def commit(self, manifest: Manifest) -> None:
        await super().commit(manifest)
        self._writing.pop((manifest.version, manifest.publisher), None)
        if manifest.shards:
            self._parts[manifest.version, manifest.publisher] = manifest
            return
        last = self._committed.get(manifest.publisher)
        if last is None or last.version < manifest.version:
            self._committed[manifest.publisher] = manifest

    async def abort(self, version: int, reason: str = "", *, shard: tuple[int, int] | None = None) -> None:
        try:
            await super().abort(version, reason, shard=shard)
        finally:
            self._forget(version)  # given up on, whatever the registry said
            if shard is not None:
                self._aborted[version] = (reason, shard)
                while len(self._aborted) > _MAX_ABORTED:
                    del self._aborted[min(self._aborted)]

    async def retire(self, version: int) -> None:
        await super().retire(version)
        self._forget(version)

    async def reclaim(self, version: int) -> None:
        try:
            await super().reclaim(version)
        except VersionNotFoundError:  # gone already (a sibling shard reclaimed it): forget it too
            self._forget(version)
            raise
        self._forget(version)

    def _forget(self, version: int) -> None:
        for journal in (self._writing, self._parts):
            for key in [k for k in journal if k[0] == version]:
                del journal[key]
        for publisher, manifest in list(self._committed.items()):
            if manifest.version == version:
                del self._committed[publisher]

    # -- relays ----------------------------------------------------------------------------

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
        await super().offer(
            version, holder=holder, host=host, descriptor=descriptor, cap=cap, landed=landed, part=part, digests=digests
        )
        self._relaying.setdefault(holder, set()).add(version)
        self._start_heartbeat()  # its offers live while it does: an idle relay must not lapse

    async def withdraw(self, version: int, *, holder: str) -> None:
        await super().withdraw(version, holder=holder)
        offered = self._relaying.get(holder, set())
        offered.discard(version)
        if not offered:
            self._relaying.pop(holder, None)

    async def release_checked(self, lease: Lease) -> bool | None:
        """End a lease, and say whether it held until then (one round trip for `is_valid`
        then `release`); None, the lease left alone, from a server of an earlier release."""
        if not self._release_checked:
            return None
        try:
            return await super().release_checked(lease)
        except MalformedMessageError as exc:
            if "unknown operation" not in str(exc):
                raise
            self._release_checked = False
            return None

    async def wait_for_version(
        self, min_version: int, timeout: float | None = None, *, publisher: str | None = None
    ) -> Manifest:
        try:
            return await super().wait_for_version(min_version, timeout, publisher=publisher)
        except PublisherLapsedError:  # not the client's timeout: the server's word, as it came
            raise
        except VersionWaitTimeoutError:
            of = "" if publisher is None else f" of {publisher!r}"
            raise VersionWaitTimeoutError(f"no version{of} >= {min_version} within {timeout} s") from None

    async def _poll(self, name: str, timeout: float | None, **values: Any) -> Any:
        """`name` as long polls of at most `wait_poll` seconds each, so that no request
        outlives a server restart by long, until it answers or `timeout` passes (then the
        server's `VersionWaitTimeoutError`)."""
        op = operations.OPERATIONS[name]
        deadline = None if timeout is None else anyio.current_time() + timeout
        while True:
            left = (
                self.wait_poll if deadline is None else max(0.0, min(self.wait_poll, deadline - anyio.current_time()))
            )
            try:
                args = op.encode_args({"timeout": left, **values})
                return op.decode_result(await self._call(name, _attempt_timeout=left + self.timeout, **args))
            except PublisherLapsedError:  # what it waits on is gone: polling again cannot help
                raise
            except VersionWaitTimeoutError:
                if deadline is not None and anyio.current_time() >= deadline:
                    raise

    # -- replicas and status -------------------------------------------------------------

    async def report_serving(self, replica: str, version: int, *, pull: PullReport | None = None) -> None:
        if pull is not None and self._pull_reports:
            try:
                await super().report_serving(replica, version, pull=pull)
            except MalformedMessageError as exc:  # a server of an earlier release takes no pull report
                if "pull" not in str(exc):
                    raise
                self._pull_reports = False
        if pull is None or not self._pull_reports:
            await super().report_serving(replica, version)
        self._serving[replica] = version
        self._start_heartbeat()  # a replica stays alive, and in `serving`, while it runs

    async def ping(self) -> str:
        """One round trip; the server's run epoch."""
        await self._call("ping")
        assert self.epoch is not None
        return self.epoch

    async def aclose(self) -> None:
        """Stop the heartbeat and close every socket. The registry's state is the
        server's: closing a client ends nothing there (leases lapse by their TTL), and a
        later call connects afresh. Closing twice is harmless."""
        self._reset(None)

    async def __aenter__(self) -> Self:
        if self._tasks is not None:
            raise InvalidArgumentError(f"{self!r} is already in use as a context manager")
        tasks = anyio.create_task_group()
        await tasks.__aenter__()
        self._tasks = tasks
        if self._beat is not None:  # one began before the block: the block owns it from now
            self._stop_heartbeat()
            self._start_heartbeat()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        """Stop the heartbeat, then close. The block's own exception propagates as it
        is; if the heartbeat failed (it logs the registry's errors, so only on a bug),
        its error does; if both did, a group of the two."""
        tasks, self._tasks = self._tasks, None
        assert tasks is not None
        try:
            return await close_owned(tasks, exc_info)
        finally:
            with anyio.CancelScope(shield=True):
                await self.aclose()

    # -- requests ------------------------------------------------------------------------

    async def _send(self, name: str, args: dict[str, Any]) -> Any:
        return await self._call(name, **args)

    async def _call(
        self, op: str, *, _attempt_timeout: float | None = None, _run: str | None = None, **args: Any
    ) -> Any:
        """Send `op` until it is answered, retrying after timeouts and a server restart.
        With `_run`, only into that run (the replay), raising `_NewRun` if it is gone."""
        req = wire.Request(uuid.uuid4().hex, op, args, _run or self.epoch)
        started = anyio.current_time()
        while True:
            # Until the server has answered once, it is reached within connect_timeout or not at all.
            bound = self.retry_for if self.epoch is not None else self._connect_bound()
            token = _HANDSHAKE_BY.set(started + bound)
            try:
                reply = await self._exchange(req, _attempt_timeout or self.timeout)
            finally:
                _HANDSHAKE_BY.reset(token)
            if reply is not None and reply.epoch_changed:
                if _run is not None:
                    raise _NewRun(reply.epoch)
                await self._adopt(reply.epoch)
            elif reply is not None:
                if reply.ok:
                    return reply.result
                assert reply.error is not None
                raise wire.error_from_dict(reply.error)
            if anyio.current_time() >= started + bound:
                never = " (it never answered this client)" if self.epoch is None else ""
                raise RegistryUnavailableError(
                    f"the registry at {self.address} did not answer {op} within {bound:g} s{never}: {UNREACHABLE_HINT}"
                )
            req = req.retry(_run or self.epoch)

    def _connect_bound(self) -> float:
        """Seconds a call waits for a server that has not answered this client yet."""
        return self.retry_for if self.connect_timeout is None else min(self.retry_for, self.connect_timeout)

    async def _exchange(self, req: wire.Request, timeout: float) -> wire.Reply | None:
        """One attempt: the reply to `req`, or None if none came within `timeout` (or a
        new connection's handshake not by the call's deadline, `_HANDSHAKE_BY`)."""
        try:
            frames = wire.encode_request(self._key, req)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"{req.op}: arguments are not JSON values: {exc}") from None
        if len(frames[0]) > self.max_message:
            raise MessageTooLargeError(f"{req.op}: request of {len(frames[0])} bytes exceeds {self.max_message}")
        conn = self._checkout()
        answered = False
        try:
            with anyio.move_on_after(timeout):
                await conn.sock.send_multipart(frames)
                if conn.monitor is not None:
                    handshake_by = _HANDSHAKE_BY.get()
                    left = timeout if handshake_by is None else handshake_by - anyio.current_time()
                    with anyio.move_on_after(max(0.0, min(timeout, left))):
                        await self._handshake(conn)
                    if conn.monitor is not None:  # no handshake in time: nothing answers there (yet)
                        return None
                while True:
                    frames = await conn.sock.recv_multipart()
                    try:
                        reply = wire.decode_reply(self._key, frames, max_bytes=self.max_message)
                    except AuthenticationError:
                        raise AuthenticationError(
                            f"the registry at {self.address} and this client do not share a secret, so it "
                            f"refused {req.op} (set ${wire.SECRET_ENV} or --secret-file to the server's secret, "
                            "or, better, give this client a key: `weightpull keys new`)"
                        ) from None
                    # Only this request is outstanding on this socket; a broken message
                    # is answered with re=None, which is also ours.
                    if reply.re in (req.nonce, None) and reply.id in (req.id, None):
                        answered = True
                        return reply
                    log.debug("dropped a reply to another request (%s)", reply.id)
            return None
        finally:
            if answered:
                self._idle.append(conn)
            else:
                conn.close()

    async def _handshake(self, conn: _Conn) -> None:
        """Wait for `conn`'s handshake: return once it succeeded, raise
        `AuthenticationError` naming the likely cause once the server refused it. (A
        server not up yet shows no event: the attempt's timeout covers it.)"""
        assert conn.monitor is not None
        while True:
            event = parse_monitor_message(await conn.monitor.recv_multipart())
            kind, value = event["event"], int(event["value"])
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                conn.unwatch()
                return
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                assert self._cert is not None
                raise AuthenticationError(
                    f"the registry at {self.address} refused the key of {self.key_principal} "
                    f"({keyfiles.named(self._cert.path, self._key_source)}, public key "
                    f"{self._cert.public[:8].decode()}...): it is unknown there or was revoked; its operator adds "
                    f"{keyfiles.file_stem(self._cert.name)}.key to the server's keys directory (the server's log "
                    "says which)"
                )
            if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                if self._cert is not None:
                    raise AuthenticationError(
                        f"the registry at {self.address} takes no keys (it serves --insecure-dev, or a "
                        f"deprecated secret) while this client has one "
                        f"({keyfiles.named(self._cert.path, self._key_source)}): drop --key and "
                        f"${keyfiles.KEY_ENV}, or serve with --keys and --server-key"
                    )
                raise AuthenticationError(
                    f"the registry at {self.address} takes keys and this client has none: pass --key "
                    f"FILE --server-key FILE (or set ${keyfiles.KEY_ENV} and ${keyfiles.SERVER_KEY_ENV}); "
                    "`weightpull keys new` makes one"
                )
            if kind in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                conn.failed += 1
                if conn.failed >= _NO_DETAIL_LIMIT:
                    if self._server is None:
                        raise AuthenticationError(
                            f"the handshake with the registry at {self.address} failed {conn.failed} times: "
                            "it likely takes keys and this client has none (pass --key and --server-key)"
                        )
                    raise AuthenticationError(
                        f"the handshake with the registry at {self.address} failed {conn.failed} times: the "
                        f"server key ({self._server.path}) is likely not this server's (pass the public .key of "
                        "the pair its `registry serve --server-key` names), or the server takes no keys "
                        "(it serves --insecure-dev, or a deprecated secret)"
                    )

    def _checkout(self) -> _Conn:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # pyzmq's asyncio sockets belong to one loop
            self._reset(loop)
        if self._idle:
            return self._idle.pop()
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)  # one I/O thread for all clients
        sock.setsockopt(zmq.LINGER, 0)
        if self._cert is not None and self._server is not None:
            assert self._cert.secret is not None
            sock.curve_secretkey = self._cert.secret
            sock.curve_publickey = self._cert.public
            sock.curve_serverkey = self._server.public
        monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        sock.connect(self.address)
        return _Conn(sock, monitor)

    def _reset(self, loop: asyncio.AbstractEventLoop | None) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
        self._stop_heartbeat()  # its sockets are closed; on another loop, it is gone anyway
        self._loop = loop
        self._adopting = anyio.Lock() if loop is not None else None

    # -- restarts ------------------------------------------------------------------------

    async def _adopt(self, epoch: str) -> None:
        """Move to the server's run `epoch`, replaying the journal into it first; the
        calls that meet the new run meanwhile wait here, then resend."""
        assert self._adopting is not None
        async with self._adopting:
            while epoch != self.epoch:
                if self.epoch is None:  # first contact: nothing to replay
                    self.epoch = epoch
                    break
                try:
                    await self._replay(epoch)
                except _NewRun as exc:  # restarted again meanwhile
                    epoch = exc.epoch
                    continue
                log.warning(
                    "registry at %s restarted (run %s -> %s); replayed %d committed, %d begun, %d serving",
                    self.address,
                    self.epoch,
                    epoch,
                    len(self._committed),
                    len(self._writing),
                    len(self._serving),
                )
                self.epoch = epoch

    async def _replay(self, run: str) -> None:
        # Aborts first: each refuses its own version's parts alone. Then oldest first:
        # versions only move forward in a run.
        for version, reason, shard in sorted((v, r, s) for v, (r, s) in self._aborted.items()):
            try:
                await self._call("abort", version=version, reason=reason, shard=list(shard), _run=run)
            except RegistryError as exc:
                self._replay_refused(exc, f"the abort of v{version}")
        for manifest in sorted([*self._committed.values(), *self._parts.values()], key=lambda m: m.version):
            shard = (manifest.shards[0].index, manifest.shards[0].count) if manifest.shards else None
            try:
                number = await self._call(
                    "begin",
                    version=manifest.version,
                    publisher=manifest.publisher,
                    slot=manifest.slot,
                    _run=run,
                    **_shard(shard),
                )
                await self._renumbered(number, manifest.version, run)
                await self._call("commit", manifest=manifest.to_dict(), _run=run)
            except RegistryError as exc:
                self._replay_refused(exc, f"v{manifest.version}")
                if shard is None:
                    del self._committed[manifest.publisher]
                else:
                    del self._parts[manifest.version, manifest.publisher]
        for (version, publisher), (slot, shard) in sorted(self._writing.items()):
            try:
                number = await self._call(
                    "begin", version=version, publisher=publisher, slot=slot, _run=run, **_shard(shard)
                )
                await self._renumbered(number, version, run)
            except RegistryError as exc:
                self._replay_refused(exc, f"v{version} (being written)")
                del self._writing[version, publisher]
        for replica, version in self._serving.items():
            await self._call("report_serving", replica=replica, version=version, _run=run)

    async def _renumbered(self, number: Any, version: int, run: str) -> None:
        """A replayed begin must get its old number back (the new run is empty but for
        what the other clients replayed first): else give the new one up, and refuse."""
        if isinstance(number, int) and not isinstance(number, bool) and number != version:
            await self._call("abort", version=number, reason=f"replay of v{version} got v{number}", _run=run)
            raise VersionNotFoundError(f"v{version} is taken in the new run (it gave v{number})")

    def _replay_refused(self, exc: RegistryError, what: str) -> None:
        """Forget `what` if the new run refused it (another publisher's newer version
        came first, say); keep it, and fail, if the run did not answer."""
        if isinstance(exc, RegistryUnavailableError):
            raise exc
        log.warning("could not re-announce %s into the restarted registry: %s", what, exc)

    def _names(self) -> list[str]:
        """The publisher and replica names this client stands by, which its heartbeat
        keeps alive at the registry."""
        names = {*self._committed, *(p for _, p in self._writing), *(p for _, p in self._parts), *self._serving}
        names |= set(self._relaying)
        return sorted(names)

    def _start_heartbeat(self) -> None:
        """Publishers and serving replicas send `keepalive`, which keeps them alive at the
        registry, and lets a restarted registry learn their versions without waiting for
        the next publish. Inside `async with` the block's task group runs
        it; outside, with no scope to run in, a task of the loop that `aclose` or the
        loop's end stops."""
        if not self.heartbeat or self._beat is not None:
            return
        self._beat = scope = anyio.CancelScope()
        if self._tasks is not None:
            self._tasks.start_soon(self._heartbeat, scope)
        else:
            self._loose = asyncio.get_running_loop().create_task(self._heartbeat(scope))

    def _stop_heartbeat(self) -> None:
        """Cancel the heartbeat (harmless if it ended, or its loop did); the next
        publish starts another."""
        if self._beat is not None:
            self._beat.cancel()
        self._beat = self._loose = None

    async def _heartbeat(self, scope: anyio.CancelScope) -> None:
        assert self.heartbeat
        try:
            with scope:
                while self._names():
                    await anyio.sleep(self.heartbeat)
                    try:
                        if self._keepalive:
                            await self._call("keepalive", names=self._names())
                        else:
                            await self._call("ping")
                    except MalformedMessageError as exc:
                        if self._keepalive and "unknown operation" in str(exc):
                            self._keepalive = False  # a server of an earlier release: ping, as it knows
                        else:
                            log.warning("heartbeat to %s failed: %s", self.address, exc)
                    except RegistryError as exc:
                        log.warning("heartbeat to %s failed: %s", self.address, exc)
        finally:
            if self._beat is scope:  # ended by itself: the next publish starts another
                self._stop_heartbeat()

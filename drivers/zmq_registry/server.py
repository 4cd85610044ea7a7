"""`weightpull registry serve`: an `InProcessRegistry` behind a ZeroMQ ROUTER socket.

One task reads requests and answers them in arrival order. Each operation of the table
(weightpull.operations) is one synchronous call on the registry's `RegistryMachine`, made
as the principal the request came from, so it runs whole before the next message is read
and no two interleave; only the long polls (`wait_for_version`, `wait_for_buckets`) wait,
on the `InProcessRegistry` around that machine, each in a task of its own. A message that fails any check (authentication, framing, size, schema) gets an error
reply and a log line, and touches nothing. Leases and liveness are judged on this
process's clock.

Who asks, in one of three modes:

- **keys** (`keys=DIR, server_key=FILE`): CURVE encryption with ZAP authentication. The
  server's ZAP handler admits a client whose public key has a certificate in DIR, and
  names it by that key (its ZeroMQ User-Id); each message's principal is looked up
  afresh in DIR's certificates (keys.py), reloaded when DIR changes, so a key added
  works at its next handshake and a key revoked stops working at its next message, even
  on a connection made before. Each refused handshake is a warning in the log, naming
  the key (its z85 prefix, and the file and principal it is known by, if any) and why
  (unknown, revoked, the server's own, not this server's key, no key at all), at most
  once a minute per key and reason on the registry's clock (`RefusalLog`): a client
  that reconnects ten times a second cannot flood it.
- **dev** (`insecure_dev=True`, or nothing): no encryption and no authentication, loopback
  addresses only; every client acts as admin.
- **secret** (`secret=`, deprecated): the HMAC framing of earlier releases; every client
  that holds the secret acts as admin.

State is not persisted: each start draws a new run epoch, every reply names it, and
clients replay into a new run what they stand by (see client.py).

With `metrics_port`, it also serves the registry's status to Prometheus over HTTP
(metrics.py), read at scrape time.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from weightpull import operations
from weightpull.errors import AuthenticationError, InvalidArgumentError, RegistryError, WeightpullError
from weightpull.principals import ADMIN, Principal
from weightpull.registry import InProcessRegistry
from weightpull.relays import RelayBook

from . import keys as keyfiles
from . import wire
from .wire import EPOCH_MISMATCH, Reply

log = logging.getLogger("weightpull.registry.server")

DEFAULT_BIND = "tcp://127.0.0.1:5555"
MAX_WAIT = 30.0  # longest a wait_for_version request is held; clients poll again
DEFAULT_LIVENESS_TTL = 10.0  # seconds a principal not heard from stays alive
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
RESCAN = 1.0  # seconds between full looks at the keys directory (besides its mtime on each message)
REFUSAL_LOG_EVERY = 60.0  # seconds between log lines about one key's refusals for one reason
_REFUSALS_KEPT = 4096  # (key, reason) pairs remembered: unknown keys cost no more than this


def is_loopback(endpoint: str) -> bool:
    """Whether `endpoint` can only be reached from this host."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # '*', an interface name or a host name: not provably local
        return False


class KeyRing:
    """The principals of a keys directory by z85 public key, kept current: reloaded when
    the directory's mtime moves (checked on every lookup, one stat) and when a full look,
    at most every `RESCAN` seconds, finds a certificate changed."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise InvalidArgumentError(f"the keys directory {str(self.directory)!r} does not exist")
        self._mtime = -1
        self._print: tuple[tuple[str, int, int], ...] | None = None
        self._scanned = -float("inf")
        self.principals: dict[bytes, Principal] = {}
        self.refusals: dict[bytes, keyfiles.Refusal] = {}  # keys known there but not admitted, and why
        self.refresh(force=True)

    def refresh(self, *, force: bool = False) -> None:
        try:
            mtime = os.stat(self.directory).st_mtime_ns
        except OSError:
            mtime = -1
        now = time.monotonic()
        if not force and mtime == self._mtime and now - self._scanned < RESCAN:
            return
        self._mtime, self._scanned = mtime, now
        current = keyfiles.fingerprint(self.directory)
        if current == self._print and not force:
            return
        self._print = current
        before = self.principals
        self.principals, self.refusals = keyfiles.scan(self.directory)
        if before or force:
            added = {str(p) for k, p in self.principals.items() if k not in before}
            gone = {str(p) for k, p in before.items() if k not in self.principals}
            if added or gone or force:
                log.info(
                    "keys in %s: %d principals%s%s",
                    self.directory,
                    len(self.principals),
                    f"; added {', '.join(sorted(added))}" if added and not force else "",
                    f"; revoked {', '.join(sorted(gone))}" if gone else "",
                )

    def lookup(self, public: bytes) -> Principal | None:
        self.refresh()
        return self.principals.get(public)

    def why_refused(self, public: bytes) -> tuple[str, str]:
        """What a key not admitted is known as here ("" if nothing names it) and why it is refused."""
        refusal = self.refusals.get(public)
        if refusal is not None:
            return refusal.known_as, refusal.why
        return "", (
            f"unknown key: no certificate in {self.directory} names it (its operator adds the client's "
            f"NAME.key there, or gives the client a key made there)"
        )


class RefusalLog:
    """Refusals of clients, each a warning line at most once per (key, reason) every
    `every` seconds on `now` (the registry's clock); the ones between are counted and
    said in the next line. Remembers at most `_REFUSALS_KEPT` pairs."""

    def __init__(self, now: Callable[[], float], every: float = REFUSAL_LOG_EVERY) -> None:
        self.now, self.every = now, every
        self._last: dict[tuple[str, str], tuple[float, int]] = {}  # (key, reason) -> (logged at, since then)

    def refused(self, key: str, why: str, line: str) -> bool:
        """Log `line` unless (key, why) was logged within `every`; whether it was logged."""
        now = self.now()
        at, since = self._last.get((key, why), (None, 0))
        if at is not None and now - at < self.every:
            self._last[key, why] = (at, since + 1)
            return False
        if len(self._last) >= _REFUSALS_KEPT:  # forget the pairs whose minute is over
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.every}
        if len(self._last) < _REFUSALS_KEPT:
            self._last[key, why] = (now, 0)
        more = f" ({since} more since {now - at:.0f} s ago, not logged)" if at is not None and since else ""
        log.warning("%s%s", line, more)
        return True


class RegistryServer:
    def __init__(
        self,
        bind: str = DEFAULT_BIND,
        *,
        keys: str | os.PathLike[str] | None = None,
        server_key: str | os.PathLike[str] | None = None,
        insecure_dev: bool = False,
        secret: bytes | None = None,
        registry: InProcessRegistry | None = None,
        liveness_ttl: float | None = DEFAULT_LIVENESS_TTL,
        max_message: int = wire.MAX_MESSAGE,
        replay_window: float = wire.REPLAY_WINDOW,
        reply_cache: int = 4096,
        max_wait: float = MAX_WAIT,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        origin_cap: int | None = None,
    ) -> None:
        """`keys` (a directory of principals' public certificates) with `server_key` (the
        server's secret certificate) serve with CURVE and ZAP; `insecure_dev` (or none of
        keys, server_key and secret) serves loopback only, unauthenticated, every client an
        admin; `secret` is the deprecated HMAC mode. `liveness_ttl` is how long a principal
        not heard from stays alive (None: never lapses) when `registry` is left to this
        server to make. `metrics_port` (0 picks a free one) serves Prometheus metrics on
        `http://metrics_host:port/metrics` while `serve` runs; they are read-only and
        unauthenticated, so the host defaults to loopback. `origin_cap` is the most live
        leases placed at a version's own slot at once (its publisher's link), for readers
        that ask for a source (`acquire(host=)`): past it, a reader is placed at a relay, or
        told `NoSourceError` to ask again (None: no cap; with a `registry` given, its own)."""
        if metrics_port is not None and (not isinstance(metrics_port, int) or not 0 <= metrics_port <= 65535):
            raise InvalidArgumentError(f"metrics_port must be a TCP port (0-65535), got {metrics_port!r}")
        chosen = [
            what for what, given in (("keys", keys or server_key), ("secret", secret), ("dev", insecure_dev)) if given
        ]
        if len(chosen) > 1:
            raise InvalidArgumentError(
                f"pick one way to authenticate clients: keys (--keys and --server-key), a secret "
                f"(deprecated) or --insecure-dev; got {' and '.join(chosen)}"
            )
        self.mode = chosen[0] if chosen else "dev"
        self.ring: KeyRing | None = None
        self.server_cert: keyfiles.Certificate | None = None
        if self.mode == "keys":
            if not keys or not server_key:
                raise InvalidArgumentError(
                    "keys mode needs both the keys directory (--keys DIR) and the server's secret "
                    "certificate (--server-key FILE)"
                )
            self.server_cert = keyfiles.load_secret_cert(server_key, "server key")
            if self.server_cert.role != "server":
                raise InvalidArgumentError(
                    f"{str(server_key)!r} is the key of {self.server_cert.role} {self.server_cert.name}, "
                    "not a server's: make one with `weightpull keys new --role server --name NAME`"
                )
            self.ring = KeyRing(keys)
        elif self.mode == "secret":
            warnings.warn(
                "serving the registry with a shared secret is deprecated and goes in a later release: "
                "give each client a key (`weightpull keys new`) and serve with keys=/server_key= "
                "(--keys/--server-key); docs/guides/registry-service.md",
                DeprecationWarning,
                stacklevel=2,
            )
        if self.mode == "dev" and not is_loopback(bind):
            raise InvalidArgumentError(
                f"refusing to serve on {bind} without authentication: the development mode serves "
                "loopback addresses only; serve with keys (--keys DIR --server-key FILE) to bind others"
            )
        self.bind = bind
        self.key = secret or b""  # the HMAC key: empty but in the deprecated secret mode
        self.epoch = secrets.token_hex(8)  # this run; a restart draws another
        if origin_cap is not None and registry is not None:
            raise InvalidArgumentError("origin_cap caps a registry the server makes; a registry given keeps its own")
        self.registry = registry or InProcessRegistry(liveness_ttl=liveness_ttl)
        self.machine = self.registry.machine  # decides every operation but waiting
        if origin_cap is not None:  # the server's own machine, nothing offered yet: a book with the cap
            self.machine.relays = RelayBook(origin_cap=origin_cap)
        self.max_message = max_message
        self.max_wait = max_wait
        self.window = wire.ReplayWindow(replay_window)
        self.replies = wire.ReplyCache(reply_cache)
        self.endpoint: str | None = None
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        self.metrics_url: str | None = None  # set while serving metrics
        self.served = 0
        self.refused = 0
        self.refusals = RefusalLog(self.registry.clock.now)

    async def serve(self, *, task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        """Bind, report the endpoint through `task_status`, and answer until cancelled."""
        if self.metrics_port is None:
            await self._serve(task_status)
            return
        from .metrics import MetricsEndpoint  # prometheus-client, only when asked for

        metrics = MetricsEndpoint(self, self.metrics_host, self.metrics_port)
        self.metrics_url = metrics.url
        try:
            await self._serve(task_status)
        finally:
            self.metrics_url = None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(metrics.close)

    async def _serve(self, task_status: anyio.abc.TaskStatus[str]) -> None:
        ctx = zmq.asyncio.Context()  # its own: the ZAP handler serves this context's sockets alone
        zap: zmq.asyncio.Socket | None = None
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Handshakes that fail before the ZAP handler is asked (no key, a wrong server key)
        # show on the socket's monitor alone.
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        # Frames over the limit get an error reply; far over it, zmq drops the
        # connection before buffering them.
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.max_message + 4096)
        try:
            async with anyio.create_task_group() as tg:
                if self.server_cert is not None:
                    assert self.server_cert.secret is not None
                    zap = ctx.socket(zmq.REP)
                    zap.setsockopt(zmq.LINGER, 0)
                    zap.bind(ZAP_ENDPOINT)
                    tg.start_soon(self._zap, zap)
                    sock.curve_server = True
                    sock.curve_secretkey = self.server_cert.secret
                    sock.curve_publickey = self.server_cert.public
                    sock.zap_domain = b"weightpull"
                try:
                    sock.bind(self.bind)
                except zmq.ZMQError as exc:
                    raise RegistryError(f"cannot bind {self.bind}: {exc}") from None
                self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
                tg.start_soon(self._watch_handshakes, monitor)
                task_status.started(self.endpoint)
                if self.machine.liveness_ttl is not None:
                    tg.start_soon(self._sweep, min(self.machine.liveness_ttl / 4, 1.0))
                while True:
                    parts = await sock.recv_multipart(copy=False)
                    peer, frames = parts[0].bytes, [f.bytes for f in parts[1:]]
                    try:
                        who = self._principal(parts[-1])
                        await self._handle(sock, tg, peer, frames, who)
                    except Exception:  # a bug must cost one message, never the server
                        log.exception("could not answer a message from peer %s", peer.hex()[:10])
        finally:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(linger=0)
            sock.close(linger=0)
            if zap is not None:
                zap.close(linger=0)
            ctx.term()

    async def _zap(self, zap: zmq.asyncio.Socket) -> None:
        """The ZAP handler: admit a CURVE client whose public key a certificate in the keys
        directory names; its User-Id is that key (z85), looked up again per message."""
        assert self.ring is not None
        while True:
            request = await zap.recv_multipart()
            version, request_id = request[0], request[1] if len(request) > 1 else b""
            status, text, user = b"400", b"Unknown key", b""
            try:
                _, _, _, address, _, mechanism, *credentials = request
                if mechanism == b"CURVE" and credentials and len(credentials[0]) == 32:
                    public = z85.encode(credentials[0])
                    principal = self.ring.lookup(public)
                    if principal is not None:
                        status, text, user = b"200", b"OK", public
                        log.debug("admitted %s from %s", principal, address.decode(errors="replace"))
                    else:
                        known_as, why = self.ring.why_refused(public)
                        self._refused_handshake(public, known_as, why, address.decode(errors="replace"))
                else:
                    text = b"CURVE only"
            except ValueError:
                text = b"Malformed ZAP request"
            await zap.send_multipart([version, request_id, status, text, user, b""])

    def _refused_handshake(self, public: bytes | None, known_as: str, why: str, where: str) -> None:
        """Count a refused handshake, and log it (once a minute per key and reason)."""
        self.refused += 1
        key = "no readable key" if public is None else f"key {public[:8].decode()}..."
        named = f" ({known_as})" if known_as else ""
        self.refusals.refused(
            "" if public is None else public.decode(), why, f"refused a handshake from {where} by {key}{named}: {why}"
        )

    async def _watch_handshakes(self, monitor: zmq.asyncio.Socket) -> None:
        """Log the handshakes refused before the ZAP handler hears of them: a client
        without a key at a keyed server (or with one at a server without keys), and one
        whose server key is not this server's (its hello cannot be decrypted)."""
        keyed = self.server_cert is not None
        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart())
            except zmq.ZMQError:  # closed as the server stops
                return
            value, where = int(event["value"]), event["endpoint"].decode(errors="replace")
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # the value is an errno
                why = (
                    f"the client hung up during the handshake ({os.strerror(value)}): likely one without a key "
                    "that gave up at once (a weightpull client does), or one that was stopped"
                    if keyed
                    else f"the handshake failed ({os.strerror(value)})"
                )
            elif value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                why = (
                    "a client without a key (it must pass --key and --server-key, or set $WEIGHTPULL_KEY "
                    "and $WEIGHTPULL_SERVER_KEY)"
                    if keyed
                    else "a client with a key, while this server takes none (it serves without --keys)"
                )
            elif self.server_cert is not None and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
                public = self.server_cert.path.with_name(keyfiles.file_stem(self.server_cert.name) + ".key")
                why = (
                    "a client whose server key is not this server's public key (its hello cannot be "
                    f"decrypted; it must pass {public} as --server-key)"
                )
            else:
                why = f"the handshake failed (ZMTP protocol error {value:#x})"
            self._refused_handshake(None, "", why, where)

    def _principal(self, frame: zmq.Frame) -> Principal | AuthenticationError:
        """Who sent this message: in keys mode the principal of its key as the keys
        directory says now (a key revoked since the handshake is refused), else admin."""
        if self.ring is None:
            return ADMIN
        try:
            user = frame.get("User-Id")
        except zmq.ZMQError:
            user = ""
        public = str(user).encode()
        principal = self.ring.lookup(public)
        if principal is None:
            known_as, why = self.ring.why_refused(public)
            named = f" ({known_as})" if known_as else ""
            self.refusals.refused(
                public.decode(),
                f"since it connected: {why}",
                f"refused a message by key {public[:8].decode()}...{named}, admitted at its handshake: {why}",
            )
            return AuthenticationError(
                f"the key {str(user)[:8]}... is no longer authorized at this registry (revoked since it "
                "connected): ask its operator for a key (`weightpull keys new`)"
            )
        return principal

    async def _handle(
        self,
        sock: zmq.asyncio.Socket,
        tg: anyio.abc.TaskGroup,
        peer: bytes,
        frames: list[bytes],
        who: Principal | AuthenticationError = ADMIN,
    ) -> None:
        try:
            if isinstance(who, AuthenticationError):
                raise who
            req = wire.decode_request(self.key, frames, max_bytes=self.max_message)
            if self.mode == "secret":  # CURVE has replay protection of its own; dev mode has none to give
                self.window.admit(req.nonce, req.ts, time.time())
            if req.epoch != self.epoch:  # a new client, or one that has not seen this run yet
                error = {"type": EPOCH_MISMATCH, "message": f"this registry is run {self.epoch}"}
                await self._send(sock, peer, Reply.failure(self.epoch, error, id=req.id, re=req.nonce))
                return
            op = wire.check_args(req)
            cached = self.replies.get(req, str(who)) if op.mutates else None
        except WeightpullError as exc:  # ProtocolError or AuthenticationError
            self.refused += 1
            if exc is not who:  # a key refused since it connected was logged by _principal, rate-limited
                log.warning("refused a message from peer %s: %s: %s", peer.hex()[:10], type(exc).__name__, exc)
            msg_id, nonce = wire.peek(frames, self.max_message)
            await self._send(sock, peer, Reply.failure(self.epoch, exc, id=msg_id, re=nonce))
            return
        if cached is not None:  # a retry: answer it as the first attempt was answered
            await self._send(sock, peer, self._reply(req, cached))
        elif operations.OPERATIONS[req.op].waits:  # answered from a task of its own
            tg.start_soon(self._wait, sock, peer, req, who)
        else:
            await self._answer(sock, peer, req, op.mutates, who)

    async def _sweep(self, every: float) -> None:
        """End a dead publisher's versions on time though nobody asks anything (each
        request sweeps first anyway)."""
        while True:
            await anyio.sleep(every)
            self.machine.sweep()

    async def _answer(
        self, sock: zmq.asyncio.Socket, peer: bytes, req: wire.Request, cache: bool, who: Principal
    ) -> None:
        try:
            # Synchronous but for the long polls, which wait at most max_wait: nothing interleaves.
            result = await operations.answer(self.registry, req.op, req.args, by=who, max_wait=self.max_wait)
            outcome: dict[str, Any] = {"ok": True, "result": result}
        except WeightpullError as exc:
            outcome = {"ok": False, "error": wire.error_to_dict(exc)}
        except Exception as exc:  # a bug: the client hears of it too
            log.exception("internal error in %s", req.op)
            outcome = {
                "ok": False,
                "error": {"type": "RegistryError", "message": f"internal error in {req.op}: {exc!r}"},
            }
        if cache:
            self.replies.put(req, outcome, str(who))
        self.served += 1
        await self._send(sock, peer, self._reply(req, outcome))

    async def _wait(self, sock: zmq.asyncio.Socket, peer: bytes, req: wire.Request, who: Principal) -> None:
        try:
            await self._answer(sock, peer, req, False, who)
        except Exception:  # in a task of the server's group: it must not end the server
            log.exception("could not answer %s from peer %s", req.op, peer.hex()[:10])

    def _reply(self, req: wire.Request, outcome: dict[str, Any]) -> Reply:
        return Reply(req.id, req.nonce, self.epoch, outcome["ok"], outcome.get("result"), outcome.get("error"))

    async def _send(self, sock: zmq.asyncio.Socket, peer: bytes, reply: Reply) -> None:
        await sock.send_multipart([peer, *wire.encode_reply(self.key, reply)])

    def _execute(self, op: str, a: dict[str, Any], by: Principal = ADMIN) -> Any:
        """Run one checked request (not a long poll) on the machine as `by`; the result as JSON values."""
        return operations.execute(self.machine, op, a, by=by)


async def run_server(server: RegistryServer, ready: Callable[[str], None]) -> None:
    """Serve until SIGINT or SIGTERM; `ready(endpoint)` once listening."""
    async with anyio.create_task_group() as tg:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            ready(await tg.start(server.serve))
            async for _ in signals:
                break
        tg.cancel_scope.cancel()
    log.info("registry run %s stopped: %d requests answered, %d refused", server.epoch, server.served, server.refused)

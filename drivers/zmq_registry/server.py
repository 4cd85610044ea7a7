"""`weightpull registry serve`: an `InProcessRegistry` behind a ZeroMQ ROUTER socket.

One task reads requests and answers them in arrival order. Each operation is one
synchronous call on the registry's `RegistryMachine`, so it runs whole before the next
message is read and no two interleave; only `wait_for_version` waits, on the
`InProcessRegistry` around that machine, in a task of its own. A message that fails any check
(framing, size, MAC, replay window, schema) gets an error reply and a log line, and
touches nothing. Leases are judged on this process's clock.

State is not persisted: each start draws a new run epoch, every reply names it, and
clients replay into a new run what they stand by (see client.py).

With `metrics_port`, it also serves the registry's status to Prometheus over HTTP
(metrics.py), read at scrape time.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import signal
import time
from collections.abc import Callable
from typing import Any

import anyio
import zmq
import zmq.asyncio

from weightpull.errors import InvalidArgumentError, ProtocolError, RegistryError, WeightpullError
from weightpull.manifest import Manifest
from weightpull.registry import InProcessRegistry, Lease

from . import wire
from .wire import EPOCH_MISMATCH, Reply

log = logging.getLogger("weightpull.registry.server")

DEFAULT_BIND = "tcp://127.0.0.1:5555"
MAX_WAIT = 30.0  # longest a wait_for_version request is held; clients poll again


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


class RegistryServer:
    def __init__(
        self,
        bind: str = DEFAULT_BIND,
        *,
        secret: bytes | None = None,
        registry: InProcessRegistry | None = None,
        max_message: int = wire.MAX_MESSAGE,
        replay_window: float = wire.REPLAY_WINDOW,
        reply_cache: int = 4096,
        max_wait: float = MAX_WAIT,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
    ) -> None:
        """`metrics_port` (0 picks a free one) serves Prometheus metrics on
        `http://metrics_host:port/metrics` while `serve` runs; they are read-only and
        unauthenticated, so the host defaults to loopback."""
        if metrics_port is not None and (not isinstance(metrics_port, int) or not 0 <= metrics_port <= 65535):
            raise InvalidArgumentError(f"metrics_port must be a TCP port (0-65535), got {metrics_port!r}")
        if not secret and not is_loopback(bind):
            raise InvalidArgumentError(
                f"refusing to serve on {bind} without a secret: set ${wire.SECRET_ENV} or pass "
                "--secret-file, or bind to a loopback address"
            )
        self.bind = bind
        self.key = secret or b""
        self.epoch = secrets.token_hex(8)  # this run; a restart draws another
        self.registry = registry or InProcessRegistry()
        self.machine = self.registry.machine  # decides every operation but waiting
        self.max_message = max_message
        self.max_wait = max_wait
        self.window = wire.ReplayWindow(replay_window)
        self.replies = wire.ReplyCache(reply_cache)
        self.endpoint: str | None = None
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        self.metrics_url: str | None = None  # set while serving metrics
        self.served = 0
        self.refused = 0

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
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Frames over the limit get an error reply; far over it, zmq drops the
        # connection before buffering them.
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.max_message + 4096)
        try:
            try:
                sock.bind(self.bind)
            except zmq.ZMQError as exc:
                raise RegistryError(f"cannot bind {self.bind}: {exc}") from None
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            task_status.started(self.endpoint)
            async with anyio.create_task_group() as tg:
                while True:
                    frames = await sock.recv_multipart()
                    try:
                        await self._handle(sock, tg, frames[0], frames[1:])
                    except Exception:  # a bug must cost one message, never the server
                        log.exception("could not answer a message from peer %s", frames[0].hex()[:10])
        finally:
            sock.close(linger=0)
            ctx.term()

    async def _handle(
        self, sock: zmq.asyncio.Socket, tg: anyio.abc.TaskGroup, peer: bytes, frames: list[bytes]
    ) -> None:
        try:
            req = wire.decode_request(self.key, frames, max_bytes=self.max_message)
            self.window.admit(req.nonce, req.ts, time.time())
            if req.epoch != self.epoch:  # a new client, or one that has not seen this run yet
                error = {"type": EPOCH_MISMATCH, "message": f"this registry is run {self.epoch}"}
                await self._send(sock, peer, Reply.failure(self.epoch, error, id=req.id, re=req.nonce))
                return
            op = wire.check_args(req)
            cached = self.replies.get(req) if op.mutates else None
        except WeightpullError as exc:  # ProtocolError or AuthenticationError
            self.refused += 1
            log.warning("refused a message from peer %s: %s: %s", peer.hex()[:10], type(exc).__name__, exc)
            msg_id, nonce = wire.peek(frames, self.max_message)
            await self._send(sock, peer, Reply.failure(self.epoch, exc, id=msg_id, re=nonce))
            return
        if cached is not None:  # a retry: answer it as the first attempt was answered
            await self._send(sock, peer, self._reply(req, cached))
        elif req.op == "wait_for_version":
            tg.start_soon(self._wait, sock, peer, req)
        else:
            await self._answer(sock, peer, req, op.mutates)

    async def _answer(self, sock: zmq.asyncio.Socket, peer: bytes, req: wire.Request, cache: bool) -> None:
        try:
            if req.op == "wait_for_version":
                result = await self._wait_for_version(req.args)
            else:
                result = self._execute(req.op, req.args)  # synchronous: nothing interleaves
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
            self.replies.put(req, outcome)
        self.served += 1
        await self._send(sock, peer, self._reply(req, outcome))

    async def _wait(self, sock: zmq.asyncio.Socket, peer: bytes, req: wire.Request) -> None:
        try:
            await self._answer(sock, peer, req, False)
        except Exception:  # in a task of the server's group: it must not end the server
            log.exception("could not answer wait_for_version from peer %s", peer.hex()[:10])

    def _reply(self, req: wire.Request, outcome: dict[str, Any]) -> Reply:
        return Reply(req.id, req.nonce, self.epoch, outcome["ok"], outcome.get("result"), outcome.get("error"))

    async def _send(self, sock: zmq.asyncio.Socket, peer: bytes, reply: Reply) -> None:
        await sock.send_multipart([peer, *wire.encode_reply(self.key, reply)])

    def _execute(self, op: str, a: dict[str, Any]) -> Any:
        """Run one checked request on the machine; the result as JSON values."""
        m = self.machine
        match op:
            case "ping":
                return None
            case "begin":
                return m.begin(a["version"], publisher=a["publisher"], slot=a["slot"], shard=_shard(a))
            case "commit":
                return m.commit(Manifest.from_dict(a["manifest"]))
            case "abort":
                return m.abort(a["version"], a["reason"], shard=_shard(a))
            case "retire":
                return m.retire(a["version"])
            case "reclaim":
                return m.reclaim(a["version"])
            case "newest":
                manifest = m.newest()
                return None if manifest is None else manifest.to_dict()
            case "get":
                return m.get(a["version"]).to_dict()
            case "acquire":
                return m.acquire(a["version"], ttl=a["ttl"], holder=a["holder"]).to_dict()
            case "renew":
                return m.renew(Lease.from_dict(a["lease"])).to_dict()
            case "release":
                return m.release(Lease.from_dict(a["lease"]))
            case "is_valid":
                return m.is_valid(Lease.from_dict(a["lease"]))
            case "report_serving":
                return m.report_serving(a["replica"], a["version"])
            case "status":
                return m.status().to_dict()
        raise ProtocolError(f"no handler for {op!r}")  # wire.OPS and this match disagree

    async def _wait_for_version(self, a: dict[str, Any]) -> Any:
        timeout = self.max_wait if a["timeout"] is None else min(a["timeout"], self.max_wait)
        return (await self.registry.wait_for_version(a["min_version"], timeout)).to_dict()


def _shard(args: dict[str, Any]) -> tuple[int, int] | None:
    shard = args.get("shard")
    return None if shard is None else (shard[0], shard[1])


async def run_server(server: RegistryServer, ready: Callable[[str], None]) -> None:
    """Serve until SIGINT or SIGTERM; `ready(endpoint)` once listening."""
    async with anyio.create_task_group() as tg:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            ready(await tg.start(server.serve))
            async for _ in signals:
                break
        tg.cancel_scope.cancel()
    log.info("registry run %s stopped: %d requests answered, %d refused", server.epoch, server.served, server.refused)

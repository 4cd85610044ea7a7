"""The registry in a named Ray actor: `RayRegistry("ray://NAME")`, for jobs that run on Ray
(verl, OpenRLHF, SkyRL) and so need no registry service of their own.

The first handle made under a name creates the actor (`get_if_exists`), every later one,
in any process of the job, finds it. The actor holds one `InProcessRegistry`, so every
decision is the same machine's as ever and leases are judged on the actor's clock, never
a caller's. It asks for no CPU (`num_cpus=0`): it must not take a slot a trainer or a
replica needs. It is an async actor, so a `wait_for_version` parked there blocks no other
call.

Records cross as the schema's dicts (`to_dict`/`from_dict`), and errors as the served
registry's error bodies, rebuilt here as the same typed exceptions an embedded registry
raises (a pickled exception would not always rebuild: some take more than a message).

Trust: Ray has no per-client authentication. Any process that can reach the Ray cluster
can find the actor by name and publish, lease or reclaim: the cluster is the trust
boundary. The registry inside acts as an admin principal; run untrusted code elsewhere.

Lifetime: the actor belongs to the process that created it (Ray's default), and dies with
it; create it from the driver, or from a process that lives as long as the job, or pass
`lifetime="detached"` and `kill()` it when done. Named actors live in a Ray namespace
(by default, the job's own), so two jobs' registries of one name never meet.
"""

from __future__ import annotations

import importlib
from typing import Any, Self

import anyio

from weightpull.errors import (
    DriverUnavailableError,
    InvalidArgumentError,
    RegistryUnavailableError,
    WeightpullError,
)
from weightpull.manifest import Manifest
from weightpull.records import Lease, RegistryStatus

SCHEME = "ray://"

# What the actor answers: the Registry protocol's operations, nothing else by name.
OPERATIONS = frozenset(
    {
        "begin",
        "commit",
        "abort",
        "retire",
        "reclaim",
        "newest",
        "get",
        "acquire",
        "renew",
        "release",
        "is_valid",
        "report_serving",
        "status",
        "wait_for_version",
    }
)


def _ray() -> Any:
    try:
        return importlib.import_module("ray")
    except ImportError as exc:
        raise DriverUnavailableError(
            f"a ray:// registry runs in a Ray actor, which needs Ray: pip install 'weightpull[verl]' or ray ({exc})"
        ) from exc


def actor_name(address: str) -> str:
    """NAME of `ray://NAME`, or `InvalidArgumentError` saying what a ray address is."""
    if not isinstance(address, str) or not address.startswith(SCHEME):
        raise InvalidArgumentError(f"a Ray registry's address is ray://NAME, got {address!r}")
    name = address[len(SCHEME) :]
    if not name or "/" in name or name.strip() != name:
        raise InvalidArgumentError(f"a Ray registry's address is ray://NAME with a non-empty NAME, got {address!r}")
    return name


def _line(publisher: str | None) -> dict[str, str]:
    """The `publisher` argument, passed only when a line is named."""
    return {} if publisher is None else {"publisher": publisher}


def _to_wire(value: Any) -> Any:
    """A record as its schema dict; a tuple (a shard) as a list; anything else as it is."""
    if isinstance(value, Manifest | Lease | RegistryStatus):
        return value.to_dict()
    return value


class RegistryActor:
    """The actor's body: one `InProcessRegistry`, on this process's clock. Its only method
    takes an operation's name and plain arguments and answers {"ok": result} or
    {"error": body}."""

    def __init__(self, max_ttl: float | None = None) -> None:
        from weightpull.registry import InProcessRegistry

        # No arguments but the TTL bound: the registry acts as an admin principal, as
        # every client of this actor is trusted alike (see the module's docstring).
        self.registry = InProcessRegistry() if max_ttl is None else InProcessRegistry(max_ttl=max_ttl)

    async def call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        from weightpull.drivers.zmq_registry.wire import error_to_dict

        if op not in OPERATIONS:
            return {"error": error_to_dict(InvalidArgumentError(f"the registry has no operation {op!r}"))}
        try:
            if op == "commit":
                args = {"manifest": Manifest.from_dict(args["manifest"])}
            elif op in ("renew", "release", "is_valid"):
                args = {"lease": Lease.from_dict(args["lease"])}
            if "shard" in args and args["shard"] is not None:
                args["shard"] = tuple(args["shard"])
            result = await getattr(self.registry, op)(**args)
        except WeightpullError as exc:
            return {"error": error_to_dict(exc)}
        return {"ok": _to_wire(result)}

    def ping(self) -> str:
        return "pong"


class RayRegistry:
    """A `Registry` whose machine runs in the named Ray actor of `address` (`ray://NAME`).

    `namespace`: the Ray namespace the name lives in (None: the job's). `max_ttl`: the
    registry's bound on a lease's TTL, used only by the handle that creates the actor.
    `lifetime`: None (the actor dies with the process that created it) or "detached".
    `timeout`: seconds to wait for the actor to answer a call (a `wait_for_version` waits
    its own timeout on top), then `RegistryUnavailableError`.

    Ray must be initialised in this process (`ray.init()`, or inside a Ray task or actor).
    Asyncio only (Ray's object refs are asyncio awaitables)."""

    def __init__(
        self,
        address: str,
        *,
        namespace: str | None = None,
        max_ttl: float | None = None,
        lifetime: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.name = actor_name(address)
        if lifetime not in (None, "detached"):
            raise InvalidArgumentError(f"lifetime must be None or 'detached', got {lifetime!r}")
        if not timeout > 0:
            raise InvalidArgumentError(f"timeout must be positive, got {timeout!r}")
        self.address = address
        self.namespace = namespace
        self.max_ttl = max_ttl
        self.lifetime = lifetime
        self.timeout = timeout
        self._actor: Any = None

    def __repr__(self) -> str:
        return f"RayRegistry({self.address!r})"

    @property
    def actor(self) -> Any:
        """The actor's handle: found by name, or created (once, whoever asks first)."""
        if self._actor is None:
            ray = _ray()
            if not ray.is_initialized():
                raise RegistryUnavailableError(
                    f"{self.address}: Ray is not initialised in this process; call ray.init() first "
                    "(inside a Ray task or actor it already is)"
                )
            options: dict[str, Any] = {"name": self.name, "get_if_exists": True, "num_cpus": 0}
            if self.namespace is not None:
                options["namespace"] = self.namespace
            if self.lifetime is not None:
                options["lifetime"] = self.lifetime
            self._actor = ray.remote(RegistryActor).options(**options).remote(self.max_ttl)
        return self._actor

    # -- the Registry protocol -------------------------------------------------------------

    async def begin(
        self, version: int | None = None, *, publisher: str, slot: int, shard: tuple[int, int] | None = None
    ) -> int:
        """The version begun: `version` while it is free, else the one the registry gave."""
        return int(await self._op("begin", version=version, publisher=publisher, slot=slot, shard=shard))

    async def commit(self, manifest: Manifest) -> None:
        await self._op("commit", manifest=manifest.to_dict())

    async def abort(self, version: int, reason: str = "", *, shard: tuple[int, int] | None = None) -> None:
        await self._op("abort", version=version, reason=reason, shard=shard)

    async def retire(self, version: int) -> None:
        await self._op("retire", version=version)

    async def reclaim(self, version: int) -> None:
        await self._op("reclaim", version=version)

    async def newest(self, *, publisher: str | None = None) -> Manifest | None:
        data = await self._op("newest", **_line(publisher))
        return None if data is None else Manifest.from_dict(data)

    async def get(self, version: int) -> Manifest:
        return Manifest.from_dict(await self._op("get", version=version))

    async def acquire(
        self, version: int | None = None, *, ttl: float, holder: str, publisher: str | None = None
    ) -> Lease:
        return Lease.from_dict(await self._op("acquire", version=version, ttl=ttl, holder=holder, **_line(publisher)))

    async def renew(self, lease: Lease) -> Lease:
        return Lease.from_dict(await self._op("renew", lease=lease.to_dict()))

    async def release(self, lease: Lease) -> None:
        await self._op("release", lease=lease.to_dict())

    async def is_valid(self, lease: Lease) -> bool:
        return bool(await self._op("is_valid", lease=lease.to_dict()))

    async def report_serving(self, replica: str, version: int) -> None:
        await self._op("report_serving", replica=replica, version=version)

    async def status(self) -> RegistryStatus:
        return RegistryStatus.from_dict(await self._op("status"))

    async def wait_for_version(
        self, min_version: int, timeout: float | None = None, *, publisher: str | None = None
    ) -> Manifest:
        """Parked in the actor (which keeps answering others meanwhile) until a version at
        least `min_version` is READY, or `timeout` passes (`VersionWaitTimeoutError`)."""
        limit = None if timeout is None else timeout + self.timeout
        args = {"min_version": min_version, "timeout": timeout, **_line(publisher)}
        data = await self._call("wait_for_version", args, limit)
        return Manifest.from_dict(data)

    # -- lifecycle -------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Drop the handle. The actor and what it holds stay (they are the job's); a later
        call finds it again. Closing twice is harmless."""
        self._actor = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def kill(self) -> None:
        """End the actor and every version and lease it holds (for a detached one, when the
        job is done)."""
        ray = _ray()
        ray.kill(self.actor)
        self._actor = None

    # -- one call --------------------------------------------------------------------------

    async def _op(self, op: str, **args: Any) -> Any:
        return await self._call(op, args, self.timeout)

    async def _call(self, op: str, args: dict[str, Any], limit: float | None) -> Any:
        """Run `op` in the actor; its answer, or its error raised here as the same type.
        A call cancelled here, or not answered within `limit` seconds, is cancelled
        there too (a parked wait ends)."""
        from weightpull.drivers.zmq_registry.wire import error_from_dict

        ray = _ray()
        ref = self.actor.call.remote(op, {k: list(v) if isinstance(v, tuple) else v for k, v in args.items()})
        try:
            with anyio.fail_after(limit):
                answer = await ref
        except TimeoutError:
            _cancel(ray, ref)
            raise RegistryUnavailableError(
                f"the registry at {self.address} did not answer {op} within {limit:g} s"
            ) from None
        except anyio.get_cancelled_exc_class():
            _cancel(ray, ref)
            raise
        except ray.exceptions.RayActorError as exc:
            self._actor = None  # found afresh (or created anew) by the next call
            raise RegistryUnavailableError(f"the registry actor at {self.address} is gone: {exc}") from exc
        if "error" in answer:
            raise error_from_dict(answer["error"])
        return answer["ok"]


def _cancel(ray: Any, ref: Any) -> None:
    """Cancel the actor's task of `ref`; one that already ended needs nothing."""
    try:
        ray.cancel(ref)
    except Exception:  # noqa: BLE001 - best effort: a finished or unknown task
        pass

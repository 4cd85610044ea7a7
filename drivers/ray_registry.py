"""The registry in a named Ray actor: `RayRegistry("ray://NAME")`, for jobs that run on Ray
(verl, OpenRLHF, SkyRL) and so need no registry service of their own.

The job's driver creates the actor (`RayRegistry.create`); every handle made later under
its name, in any process of the job, finds it. The actor holds one `InProcessRegistry`, so every
decision is the same machine's as ever and leases are judged on the actor's clock, never
a caller's. It asks for no CPU (`num_cpus=0`): it must not take a slot a trainer or a
replica needs. It is an async actor, so a `wait_for_version` parked there blocks no other
call.

Every operation is made from the table of operations (weightpull.operations): arguments
and results cross as the same JSON values as on the served registry's wire, checked by
the same schema, and errors as its error bodies, rebuilt here as the same typed exceptions
an embedded registry raises (a pickled exception would not always rebuild: some take more
than a message).

Trust: Ray has no per-client authentication, so callers prove who they are with a token.
The job's driver makes the actor with `RayRegistry.create(address, principals=[...])`,
which draws a secret token per principal and gives the actor only their digests; the
driver hands each worker its own token (an argument of its task or actor, or
`$WEIGHTPULL_RAY_TOKEN`), and every call is made as the principal its token proves: the
machine then refuses a reader's begin, commit or retire of the trainer's versions as a
served registry does. A call with no token, or one the actor did not hand out, is refused
with `AuthenticationError` saying what to pass. What a token does not stop: code that
can read the driver's memory or a worker's environment (the job's own code), and anyone
who can kill actors on the cluster. A handle made without a token (deprecated, for a
release) creates or finds an open actor, where every caller acts as admin.

Lifetime: the actor belongs to the process that created it (Ray's default), and dies with
it; create it from the driver, or from a process that lives as long as the job, or pass
`lifetime="detached"` and `kill()` it when done. Named actors live in a Ray namespace
(by default, the job's own), so two jobs' registries of one name never meet.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import logging
import os
import secrets
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Self

import anyio

from weightpull import operations
from weightpull.errors import (
    AuthenticationError,
    DriverUnavailableError,
    InvalidArgumentError,
    RegistryUnavailableError,
    WeightpullError,
)
from weightpull.operations import OperationsClient
from weightpull.principals import ADMIN, Principal

log = logging.getLogger("weightpull.registry.ray")
SCHEME = "ray://"
TOKEN_ENV = "WEIGHTPULL_RAY_TOKEN"  # a worker's token, when not passed as token=

# What the actor answers: the table's operations, nothing else by name.
OPERATIONS = frozenset(operations.OPERATIONS)


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


def _digest(token: str) -> str:
    """What the actor keeps of a token: never the token itself."""
    return hashlib.sha256(token.encode()).hexdigest()


class RegistryActor:
    """The actor's body: one `InProcessRegistry`, on this process's clock. Its `call`
    takes an operation's name, its arguments as the table's JSON values and the caller's
    token, and answers {"ok": result} or {"error": body}.

    `principals` maps each token's digest to the principal it proves (a `Principal`'s
    dict); None makes an open registry, every caller an admin (deprecated)."""

    def __init__(
        self,
        max_ttl: float | None = None,
        principals: Mapping[str, Mapping[str, Any]] | None = None,
        liveness_ttl: float | None = None,
        address: str = "",
        origin_cap: int | None = None,
    ) -> None:
        from weightpull.registry import InProcessRegistry
        from weightpull.relays import RelayBook

        options: dict[str, Any] = {"liveness_ttl": liveness_ttl}
        if max_ttl is not None:
            options["max_ttl"] = max_ttl
        self.registry = InProcessRegistry(**options)
        if origin_cap is not None:  # nothing offered yet: a book with the cap, as a server's
            self.registry.machine.relays = RelayBook(origin_cap=origin_cap)
        self.address = address
        self.principals = (
            None if principals is None else {d: Principal.from_dict(dict(p)) for d, p in principals.items()}
        )

    def _who(self, token: str | None) -> Principal:
        if self.principals is None:
            return ADMIN  # an open registry: every caller alike
        if not token:
            raise AuthenticationError(
                f"the registry at {self.address} takes tokens and this caller sent none: pass "
                f"RayRegistry(..., token=) (or set ${TOKEN_ENV}) to the token the job's driver got for "
                "this worker's principal from RayRegistry.create(..., principals=...)"
            )
        principal = self.principals.get(_digest(token))
        if principal is None:
            raise AuthenticationError(
                f"the registry at {self.address} handed out no such token (another job's, or mistyped): "
                "pass the token the job's driver got for this worker's principal from its "
                "RayRegistry.create(..., principals=...).tokens"
            )
        return principal

    async def call(self, op: str, args: dict[str, Any], token: str | None = None) -> dict[str, Any]:
        from weightpull.drivers.zmq_registry.wire import Request, check_args, error_to_dict

        try:
            who = self._who(token)
            if op not in OPERATIONS:
                raise InvalidArgumentError(f"the registry has no operation {op!r}")
            # A handle of an earlier release passed an optional argument unset as None.
            optional = operations.OPERATIONS[op].optional
            args = {k: v for k, v in args.items() if v is not None or k not in optional}
            check_args(Request("ray", op, args, None))  # the served registry's checks, by the same table
            result = await operations.answer(self.registry, op, args, by=who, max_wait=None)
        except WeightpullError as exc:
            return {"error": error_to_dict(exc)}
        return {"ok": result}

    def ping(self) -> str:
        return "pong"

    def liveness_ttl(self) -> float | None:
        """How long a principal not heard from stays alive here (None: never lapses)."""
        return self.registry.machine.liveness_ttl


class RayRegistry(OperationsClient):
    """A `Registry` whose machine runs in the named Ray actor of `address` (`ray://NAME`):
    every operation of the table (streaming, reservations, relays, `release_checked`,
    `keepalive`, `status` and the long polls), each made as the caller's principal.

    Who calls: the job's driver makes the actor with `RayRegistry.create(address,
    principals=[...])`, which draws a secret token per principal (`.tokens`); each worker
    makes its handle with `token=` its principal's (else `$WEIGHTPULL_RAY_TOKEN`). A
    handle with a token finds the actor and never creates one. A handle without a token
    (deprecated) creates or finds an open actor, where every caller acts as admin.

    Args:
        address: `ray://NAME`.
        token: this caller's token (None: `$WEIGHTPULL_RAY_TOKEN`, else none).
        namespace: the Ray namespace the name lives in (None: the job's).
        max_ttl: the registry's bound on a lease's TTL, used only by the handle that
            creates the actor.
        lifetime: None (the actor dies with the process that created it) or "detached".
        timeout: seconds to wait for the actor to answer a call (a long poll waits its
            own timeout on top), then `RegistryUnavailableError`.
        heartbeat: at a registry that judges liveness, seconds between the `keepalive`s
            that keep the publisher, replica and relay names this handle stands by alive
            (from its first begin, report or offer until `aclose`); None: none.

    Raises:
        InvalidArgumentError: a bad address, lifetime or timeout.

    Ray must be initialised in this process (`ray.init()`, or inside a Ray task or actor).
    Asyncio only (Ray's object refs are asyncio awaitables)."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        namespace: str | None = None,
        max_ttl: float | None = None,
        lifetime: str | None = None,
        timeout: float = 60.0,
        heartbeat: float | None = 1.0,
    ) -> None:
        self.name = actor_name(address)
        if lifetime not in (None, "detached"):
            raise InvalidArgumentError(f"lifetime must be None or 'detached', got {lifetime!r}")
        if not timeout > 0:
            raise InvalidArgumentError(f"timeout must be positive, got {timeout!r}")
        self.address = address
        self.token = token or os.environ.get(TOKEN_ENV) or None
        self.namespace = namespace
        self.max_ttl = max_ttl
        self.lifetime = lifetime
        self.timeout = timeout
        self.tokens: dict[Principal, str] = {}  # filled by `create`: what the driver hands out
        self.heartbeat = heartbeat
        self._actor: Any = None
        self._standing: set[str] = set()  # publisher, replica and relay names its heartbeat keeps alive
        self._beat: asyncio.Task[None] | None = None
        self._ttl: list[float | None] | None = None  # the registry's liveness TTL, once asked
        if self.token is None:
            warnings.warn(
                f"a Ray registry handle without a token ({address}) acts as admin, so any code of the job can "
                "act as the trainer; this goes in a later release: make the registry with "
                "RayRegistry.create(address, principals=[...]) and give each worker token= its principal's "
                "(docs/guides/verl.md)",
                DeprecationWarning,
                stacklevel=2,
            )

    @classmethod
    def create(
        cls,
        address: str,
        *,
        principals: Iterable[Principal],
        namespace: str | None = None,
        max_ttl: float | None = None,
        liveness_ttl: float | None = None,
        origin_cap: int | None = None,
        lifetime: str | None = None,
        timeout: float = 60.0,
    ) -> RayRegistry:
        """Make the registry actor of `address`, knowing `principals`, and return the
        driver's handle on it, which acts as admin. Its `tokens` holds a fresh secret token
        per principal: hand each worker its own (`RayRegistry(address, token=...)`).

        Args:
            principals: who may call it: each a `Principal` (publisher, reader or admin).
            liveness_ttl: seconds a principal not heard from stays alive (None: never
                lapses, the default); each handle's heartbeat keeps its names alive.
            origin_cap: the most live leases placed at a version's own slot at once, for
                readers that ask for a source (`acquire(host=)`); past it, a reader is
                placed at a relay or told `NoSourceError` (None: no cap).

        Raises:
            InvalidArgumentError: no principals, one twice, or the name is taken.
        """
        chosen = list(principals)
        if not chosen or not all(isinstance(p, Principal) for p in chosen):
            raise InvalidArgumentError(f"principals must be one or more Principals, got {chosen!r}")
        if len(set(chosen)) != len(chosen):
            raise InvalidArgumentError(f"a principal is named twice in {chosen!r}")
        tokens = {p: secrets.token_urlsafe(32) for p in [ADMIN, *chosen]}
        handle = cls(
            address, token=tokens[ADMIN], namespace=namespace, max_ttl=max_ttl, lifetime=lifetime, timeout=timeout
        )
        ray = _ray()
        handle._require_ray(ray)
        options = handle._options(get_if_exists=False)
        digests = {_digest(t): p.to_dict() for p, t in tokens.items()}
        try:
            handle._actor = (
                ray.remote(RegistryActor).options(**options).remote(max_ttl, digests, liveness_ttl, address, origin_cap)
            )
        except ValueError as exc:  # the name is taken
            raise InvalidArgumentError(f"cannot create the registry actor {address}: {exc}") from None
        handle.tokens = {p: t for p, t in tokens.items() if p in chosen}
        return handle

    def __repr__(self) -> str:
        return f"RayRegistry({self.address!r})"

    def _require_ray(self, ray: Any) -> None:
        if not ray.is_initialized():
            raise RegistryUnavailableError(
                f"{self.address}: Ray is not initialised in this process; call ray.init() first "
                "(inside a Ray task or actor it already is)"
            )

    def _options(self, **extra: Any) -> dict[str, Any]:
        options: dict[str, Any] = {"name": self.name, "num_cpus": 0, **extra}
        if self.namespace is not None:
            options["namespace"] = self.namespace
        if self.lifetime is not None:
            options["lifetime"] = self.lifetime
        return options

    @property
    def actor(self) -> Any:
        """The actor's handle: found by name; created (open, deprecated) by a handle
        without a token when none runs yet."""
        if self._actor is None:
            ray = _ray()
            self._require_ray(ray)
            if self.token is None:
                options = self._options(get_if_exists=True)
                self._actor = (
                    ray.remote(RegistryActor).options(**options).remote(self.max_ttl, None, None, self.address)
                )
            else:
                try:
                    self._actor = ray.get_actor(self.name, namespace=self.namespace)
                except ValueError:
                    raise RegistryUnavailableError(
                        f"no registry actor runs at {self.address} (yet): the job's driver makes it with "
                        "RayRegistry.create(address, principals=...) before handing out tokens"
                    ) from None
        return self._actor

    # -- liveness --------------------------------------------------------------------------

    async def _stand_by(self, name: str) -> None:
        """Keep `name` alive from now on, with a heartbeat if the registry judges liveness
        (the first time, it asks whether it does)."""
        self._standing.add(name)
        if not self.heartbeat or (self._beat is not None and not self._beat.done()):
            return
        if self._ttl is None:
            self._ttl = [await self.actor.liveness_ttl.remote()]  # asked once: it never changes
        ttl = self._ttl[0]
        if ttl is not None and (self._beat is None or self._beat.done()):  # none began meanwhile
            self._beat = asyncio.get_running_loop().create_task(self._heartbeat(min(self.heartbeat, ttl / 4)))

    async def _heartbeat(self, every: float) -> None:
        while self._standing:
            await asyncio.sleep(every)
            try:
                await self.keepalive(tuple(sorted(self._standing)))
            except WeightpullError as exc:
                log.warning("heartbeat to %s failed: %s", self.address, exc)

    # -- lifecycle -------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop the heartbeat and drop the handle. The actor and what it holds stay (they
        are the job's); a later call finds it again. Closing twice is harmless."""
        beat, self._beat = self._beat, None
        if beat is not None:
            beat.cancel()
        self._standing.clear()
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

    async def _send(self, name: str, args: dict[str, Any]) -> Any:
        return await self._call(name, args, self.timeout)

    async def _poll(self, name: str, timeout: float | None, **values: Any) -> Any:
        """Parked in the actor (which keeps answering others meanwhile) until it may be
        answered, or `timeout` passes (`VersionWaitTimeoutError`)."""
        op = operations.OPERATIONS[name]
        limit = None if timeout is None else timeout + self.timeout
        return op.decode_result(await self._call(name, op.encode_args({"timeout": timeout, **values}), limit))

    async def _call(self, op: str, args: dict[str, Any], limit: float | None) -> Any:
        """Run `op` in the actor; its answer, or its error raised here as the same type.
        A call cancelled here, or not answered within `limit` seconds, is cancelled
        there too (a parked wait ends)."""
        from weightpull.drivers.zmq_registry.wire import error_from_dict

        ray = _ray()
        ref = self.actor.call.remote(op, args, self.token)
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

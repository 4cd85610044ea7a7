"""Every error weightpull raises, named after the condition it reports.

Catch `WeightpullError` for all of them. Errors about bad arguments also derive from
`ValueError`, errors about waiting too long from `TimeoutError`. Each says when it is
raised and the usual fix. The ones a user catches most are also at the top level
(`weightpull.TornReadError`); the others' names there are deprecated (they warn, and go in
the next release).
"""

from __future__ import annotations


def first_error(exc: BaseException) -> BaseException:
    """The first real failure inside (nested) exception groups.

    Args:
        exc: An error, or an exception group a task group raised.

    Returns:
        The task group's error to name, not a cancellation it caused; `exc` itself when it
        is no group.
    """
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, _cancelled())]
        exc = (inner or list(exc.exceptions))[0]
    return exc


def _cancelled() -> tuple[type[BaseException], ...]:
    """What cancellation raises: asyncio's, and the running async library's if any."""
    import asyncio

    import anyio

    try:
        return (asyncio.CancelledError, anyio.get_cancelled_exc_class())
    except Exception:  # called outside an event loop (the CLI): anyio knows no library
        return (asyncio.CancelledError,)


class WeightpullError(Exception):
    """Base of every error raised by weightpull.

    Catch it to handle any of them; the message always names what failed and, where there
    is one, the fix.
    """


class InvalidArgumentError(WeightpullError, ValueError):
    """An argument was malformed or out of range; the message names it.

    Raised by constructors and calls before anything is done (a `Publisher` with one slot,
    a negative `ttl`, a record that does not decode). Also a `ValueError`.

    Fix: pass what the message asks for; nothing needs cleaning up.
    """


class InvalidTransitionError(WeightpullError):
    """A state machine was asked for an event its current state does not allow.

    Raised by the version, lease and slot machines (`weightpull.states`), e.g. renewing a
    released lease or committing an aborted version; `machine`, `state`, `event` and
    `subject` say which. Usually a caller's bug: the object was used after it ended.
    """

    def __init__(self, machine: str, state: object, event: object, subject: str = "") -> None:
        self.machine, self.state, self.event, self.subject = machine, state, event, subject
        what = f"{machine} {subject}".strip()
        super().__init__(f"{what}: event {event!s} is not allowed in state {state!s}")


# -- registry ----------------------------------------------------------------------------


class RegistryError(WeightpullError):
    """The registry refused a request.

    Base of every refusal of the registry, embedded or served; catch it to handle any.
    """


class VersionOrderError(RegistryError, InvalidArgumentError):
    """A version number did not exceed every version published before it.

    Raised by `Publisher.publish` (and the registry's `begin`) for a number at or below one
    already given in the line. Fix: publish increasing numbers (the trainer's step), or
    pass `version=None` for the next free number. Also an `InvalidArgumentError`.
    """


class VersionNotFoundError(RegistryError, LookupError):
    """No such version (never published, or already reclaimed).

    Raised by lookups that name a version: `manifest`, `acquire(version=...)`, `retire`.
    Fix: ask for the newest (`acquire()` without a version) or a version still listed by
    `status()`. Also a `LookupError`.
    """


class NoReadyVersionError(RegistryError, LookupError):
    """No version is READY yet.

    Raised by `Puller.pull` and `acquire` before the first publish of the line they follow
    has committed; the message names the line. Fix: wait with `wait_for_version`, or let
    an `UpdateAgent` wait for the next version. Also a `LookupError`.
    """


class VersionStateError(RegistryError):
    """The version exists, but its state does not allow the request.

    Raised for a lease on a RETIRED version, the manifest of one still WRITING, a mark on
    one that is not STREAMING...; the message names both the state and the request. Fix:
    acquire the newest READY version again.
    """


class VersionInUseError(RegistryError):
    """The version cannot be reclaimed: leases on it are alive, or it is the newest READY.

    Raised by the registry's `reclaim`, and by `begin` for a slot that still holds a
    version not reclaimed. Fix: wait for its readers' leases to end (`ttl` at most) and retry; the
    newest READY version is never reclaimed.
    """


class LeaseNotFoundError(RegistryError, LookupError):
    """The registry knows no such lease: never granted, pruned, or forgotten with its
    reclaimed version.

    Raised by `renew` and `release` with an unknown lease id (renewing a released one is
    an `InvalidTransitionError`). Fix: acquire a new lease. Also a `LookupError`.
    """


class LeaseExpiredError(RegistryError):
    """The lease's TTL ran out on the registry's clock before this request.

    Raised by `renew` of a lease not renewed within `ttl`: a
    paused process, a renewal starved by a blocked event loop. What was read under it
    is not trusted. Fix: acquire again; raise `ttl` or renew more often
    (`renew_every`) if it recurs.
    """


class NoSourceError(RegistryError, LookupError):
    """No source may serve the version to this reader now.

    Raised by `acquire` when every source of the version (its publisher's slot and the
    relays offering it) is gone (its liveness lapsed), full (at its cap of live leases) or
    excluded; the message says which. Fix: retry after a moment, or allow more leases per
    source. Also a `LookupError`.
    """


# -- the served registry -------------------------------------------------------------------


class PermissionDeniedError(RegistryError, PermissionError):
    """The principal that asked may not do this.

    Raised by a keyed registry for another principal's lease, version or report, or an
    operation its role lacks (a reader beginning a version); the message names who asked,
    what, and the rule. Fix: use the key of the principal that owns it, or give this
    principal the role (`weightpull keys`). Also a `PermissionError`.
    """


class RegistryUnavailableError(RegistryError, TimeoutError):
    """A served registry did not answer within the client's whole retry deadline.

    Raised by `ZmqRegistry` calls after `retry_for` seconds (30 by default) of retries, or
    after `connect_timeout` (5) while the server has never answered that client: the
    server is down, unreachable, or the address is wrong. Fix: check that `weightpull
    registry serve` runs at that address (`weightpull status ADDRESS`); the message asks
    it too. Also a `TimeoutError`.
    """


class AuthenticationError(RegistryError):
    """The registry and this client could not authenticate each other.

    Raised by a served registry's client whose key the server does not know, that has no
    key where keys are required (or one where none are), or whose shared secret differs;
    the message says which and what to pass (`--key`, `--server-key`).
    """


class ProtocolError(RegistryError):
    """A message broke the served registry's wire protocol; the message says how.

    Base of the wire errors; usually a client and server of different releases, or
    something other than a weightpull client talking to the port.
    """


class MalformedMessageError(ProtocolError, InvalidArgumentError):
    """A message was not framed, encoded or typed as the protocol requires.

    Also an `InvalidArgumentError` (a `ValueError`), as an embedded registry's refusal of
    a wrong-typed argument is; the message names the field.
    """


class MessageTooLargeError(ProtocolError):
    """A message exceeded the size limit.

    Raised by the served registry's client and server for a request or reply over
    `max_message` bytes. Fix: raise `max_message` on both sides.
    """


class ReplayedMessageError(ProtocolError):
    """A request reused a nonce, or its timestamp fell outside the replay window.

    Raised by a served registry guarding against replays; a client whose clock is far
    off the server's gets it too. Fix: sync the clocks; a fresh request succeeds.
    """


# -- publish / pull ------------------------------------------------------------------------


class PublishError(WeightpullError):
    """A publish did not complete; the version it started is ABORTED.

    Raised by `Publisher.publish` when writing or announcing a version failed; readers
    never see the aborted version. Catch it to skip the version and publish the next.
    """


class NoFreeSlotError(PublishError):
    """Every slot holds a version that is leased or is the newest READY.

    Raised by `Publisher.publish` with `when_full=WhenFull.FAIL`, before any version is
    begun. Fix: more slots (`num_slots`), shorter reader leases, or `WhenFull.WAIT`.
    """


class SlotWaitTimeoutError(NoFreeSlotError, TimeoutError):
    """The publisher waited its whole bound for a free slot.

    Raised by `Publisher.publish` with `WhenFull.WAIT` (or a sharded publish under the
    default, `WhenFull.WAIT_THEN_SKIP`) after `wait_timeout` seconds without a free
    slot: readers hold every slot. Fix: more slots, a longer `wait_timeout`, or
    `WhenFull.WAIT_THEN_SKIP` / `WhenFull.SKIP`. Also a `TimeoutError`.
    """


class PullError(WeightpullError):
    """A pull did not produce a usable copy; nothing was handed on.

    Base of the pull's failures; the mirror keeps no half-trusted version. Catch it to
    retry the pull (an `UpdateAgent` retries on its own).
    """


class TornReadError(PullError):
    """The lease lapsed while reading: the copy may mix versions and was rejected.

    Raised by `Puller.pull` when its lease expired or the version was retired before the
    read completed and was checked. Fix: pull again; if it recurs, raise the lease `ttl`
    or give the publisher more slots so versions are not reused mid-read.
    """


class DigestMismatchError(PullError):
    """A bucket's bytes did not match the digest the publisher recorded.

    Raised by `Puller.pull` with digest checks on: the copy was corrupted in transit or
    in the source's memory. Fix: pull again; a repeat points at the transport or the
    source's hardware.
    """


class NoProgressError(PullError, TimeoutError):
    """No read of a pull landed for the puller's whole `stall_timeout`.

    Raised by `Puller.pull` when the source makes no progress: its publisher hangs, or
    does not serve its transport's progress (`async with Publisher(...)`, or
    `publisher.serve()`). A slow source whose reads keep landing is not this. Fix: keep
    the publisher's event loop running; raise `stall_timeout` for a source that is slow
    to start. Also a `TimeoutError`.
    """


class VersionWaitTimeoutError(WeightpullError, TimeoutError):
    """No version at least as new as the one asked for arrived in time.

    Raised by `wait_for_version(min_version, timeout=...)` on its timeout. Fix: wait
    again, or check that the trainer still publishes (`weightpull status`). Also a
    `TimeoutError`.
    """


class PublisherLapsedError(VersionWaitTimeoutError):
    """The publisher a wait was waiting on lapsed: the version it waits for will not come.

    Raised by a wait on a version (`wait_for_version`, `wait_for_buckets` of a version not
    begun yet, `Puller.borrow(wait=...)`, `UpdateAgent.wait_for_version`) once the registry
    takes the publisher of the line it follows for dead (not heard from for the registry's
    `liveness_ttl`), instead of at the wait's own timeout; `publisher` names it (empty when
    read back from a served registry: the message names it). A publisher that is slow but
    alive ends no wait. Fix: restart the publisher (it is taken back when it is heard from
    again), then wait again. Also a `VersionWaitTimeoutError`, so code that handled the
    timeout handles this too.
    """

    def __init__(self, message: str, *, publisher: str = "") -> None:
        super().__init__(message)
        self.publisher = publisher


class ReplicasLeftError(WeightpullError):
    """Replicas a trainer waited on left (their liveness lapsed) before serving the version.

    Raised by `wait_until_served`; `replicas` names them (empty when read back from a
    served registry: the message names them). Fix: see why they died (their logs), restart
    them, or wait again for the replicas that are left.
    """

    def __init__(self, message: str, *, replicas: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.replicas = replicas


# -- transports --------------------------------------------------------------------------


class TransportError(WeightpullError):
    """A transport failed to move bytes.

    Base of the transports' failures; during a pull it ends the pull, and the next pull
    may succeed from another source.
    """


class RegionNotRegisteredError(TransportError):
    """A read touched memory that was never registered (or no longer is).

    Raised by a transport reading a region its owner closed or deregistered (a publisher
    that restarted). Fix: pull again: the registry names the current slot.
    """


class PeerGoneError(TransportError):
    """The peer that owns the remote memory has exited or closed its transport.

    Raised by a transport reading from a dead publisher or relay. Fix: pull again once the
    registry's liveness drops that source, or restart the publisher.
    """


class UnknownDriverError(WeightpullError, LookupError):
    """No transport driver of that name is built in or installed.

    Raised by `create_transport(name)`. Fix: one of `list_transports()`, or install the
    package that registers the driver. Also a `LookupError`.
    """


class DriverUnavailableError(WeightpullError, ImportError):
    """The driver is known but cannot load here; the message names the missing extra.

    Raised by `create_transport(name)` when its library is missing (`pip install
    weightpull[nixl]`). Also an `ImportError`.
    """


# -- replicas: update agent, apply, dispatch -----------------------------------------------


class ApplyError(WeightpullError):
    """Loading a pulled version into an engine's weights failed.

    The replica was given back the last good version (`restored`) and may serve it again,
    or, if even that failed, it holds no defined weights (`restored` is None), stays paused
    and must not serve. The cause (`__cause__`) names what did not load.
    """

    def __init__(self, message: str, *, version: int, restored: int | str | None) -> None:
        super().__init__(message)
        self.version, self.restored = version, restored


class ReplicaUpdateError(WeightpullError):
    """A replica refused or failed a step of vLLM's weight-update handshake, driven by the
    `weightpull` backend's trainer engine: the version stays published, and the replica
    serves what it served before. The message is the replica's own (a bad init, an
    unknown version, a version that does not load, a publisher that lapsed).
    """


class IncompleteApplyError(WeightpullError):
    """An apply did not reach every weight the engine computes with.

    Raised by the vLLM integration when a layer got none or only some of its weights (it
    would keep the previous version's), a published tensor loaded nowhere, or tied tensors
    were published with different bytes; names them. Fix: publish every parameter the
    engine's model has, under the names it loads.
    """


class ApplyCheckError(WeightpullError):
    """The check after an apply found tensors whose bytes differ from what the same
    loading makes of the pulled copy.

    Raised by the vLLM integration's check after an apply; names the tensors. It points at
    an engine whose loading the integration does not model (file an issue).
    """


class UnsupportedModelError(WeightpullError):
    """An engine's model cannot be updated in place whole; refused at start-up.

    Raised by the vLLM integration for a model whose weights it cannot reload in place;
    the message says why.
    """


class AgentFailedError(WeightpullError):
    """A replica's update agent stopped on an error.

    What waited on it (`UpdateAgent.wait_changed`, the agent's other callers) fails with this, chained to the cause,
    instead of waiting forever. Fix: see the cause.
    """


class NoProducerError(WeightpullError):
    """Every producer a trainer's sample waits on has died, failed or gone silent.

    Raised by `Health.check`, and so by the `Sampler`'s wait: the sample would never come. The
    message names each producer and what became of it.
    """


class StaleSampleError(WeightpullError):
    """A training sample held a group older than the staleness bound allows.

    Raised by `StalenessClock.check`. Fix: evict stale groups first
    (`ReplayBuffer`, which asks the same clock), or raise the bound.
    """

"""Every error weightpull raises, named after the condition it reports.

Catch `WeightpullError` for all of them. Errors about bad arguments also derive from
`ValueError`, errors about waiting too long from `TimeoutError`.
"""

from __future__ import annotations


def first_error(exc: BaseException) -> BaseException:
    """The first real failure inside (nested) exception groups: a task group's error to
    name, not a cancellation it caused."""
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
    """Base of every error raised by weightpull."""


class InvalidArgumentError(WeightpullError, ValueError):
    """An argument was malformed or out of range; the message names it."""


class InvalidTransitionError(WeightpullError):
    """A state machine was asked for an event its current state does not allow."""

    def __init__(self, machine: str, state: object, event: object, subject: str = "") -> None:
        self.machine, self.state, self.event, self.subject = machine, state, event, subject
        what = f"{machine} {subject}".strip()
        super().__init__(f"{what}: event {event!s} is not allowed in state {state!s}")


# -- registry ----------------------------------------------------------------------------


class RegistryError(WeightpullError):
    """The registry refused a request."""


class VersionOrderError(RegistryError, InvalidArgumentError):
    """A version number did not exceed every version published before it."""


class VersionNotFoundError(RegistryError, LookupError):
    """No such version (never published, or already reclaimed)."""


class NoReadyVersionError(RegistryError, LookupError):
    """No version is READY yet."""


class VersionStateError(RegistryError):
    """The version exists, but its state does not allow the request (a lease on a
    RETIRED version, the manifest of one still WRITING...); the message names both."""


class VersionInUseError(RegistryError):
    """The version cannot be reclaimed: leases on it are alive, or it is the newest READY."""


class LeaseNotFoundError(RegistryError, LookupError):
    """The registry knows no such lease: never granted, pruned, or forgotten with its
    reclaimed version. (Renewing a released one is an `InvalidTransitionError`.)"""


class LeaseExpiredError(RegistryError):
    """The lease's TTL ran out on the registry's clock before this request."""


class NoSourceError(RegistryError, LookupError):
    """No source may serve the version to this reader now: every one is gone (its
    liveness lapsed), full (at its cap of live leases) or excluded; the message says which."""


# -- the served registry -------------------------------------------------------------------


class PermissionDeniedError(RegistryError, PermissionError):
    """The principal that asked may not do this (another's lease, version or report, or
    an operation its role lacks); the message names who asked, what, and the rule."""


class RegistryUnavailableError(RegistryError, TimeoutError):
    """A served registry did not answer within the client's whole retry deadline."""


class AuthenticationError(RegistryError):
    """A message failed its HMAC check: the two sides do not share the secret."""


class ProtocolError(RegistryError):
    """A message broke the served registry's wire protocol; the message says how."""


class MalformedMessageError(ProtocolError, InvalidArgumentError):
    """A message was not framed, encoded or typed as the protocol requires (a ValueError,
    as an embedded registry's refusal of a wrong-typed argument is)."""


class MessageTooLargeError(ProtocolError):
    """A message exceeded the size limit."""


class ReplayedMessageError(ProtocolError):
    """A request reused a nonce, or its timestamp fell outside the replay window."""


# -- publish / pull ------------------------------------------------------------------------


class PublishError(WeightpullError):
    """A publish did not complete; the version it started is ABORTED."""


class NoFreeSlotError(PublishError):
    """Every slot holds a version that is leased or is the newest READY."""


class SlotWaitTimeoutError(NoFreeSlotError, TimeoutError):
    """The publisher waited its whole bound for a free slot."""


class PullError(WeightpullError):
    """A pull did not produce a usable copy; nothing was handed on."""


class TornReadError(PullError):
    """The lease lapsed while reading: the copy may mix versions and was rejected."""


class DigestMismatchError(PullError):
    """A bucket's bytes did not match the digest the publisher recorded."""


class NoProgressError(PullError, TimeoutError):
    """No read of a pull landed for the puller's whole `stall_timeout`: the source makes
    no progress (its publisher hangs, or does not serve its transport's progress). A
    slow source whose reads keep landing is not this."""


class VersionWaitTimeoutError(WeightpullError, TimeoutError):
    """No version at least as new as the one asked for arrived in time."""


# -- transports --------------------------------------------------------------------------


class TransportError(WeightpullError):
    """A transport failed to move bytes."""


class RegionNotRegisteredError(TransportError):
    """A read touched memory that was never registered (or no longer is)."""


class PeerGoneError(TransportError):
    """The peer that owns the remote memory has exited or closed its transport."""


class UnknownDriverError(WeightpullError, LookupError):
    """No transport driver of that name is built in or installed."""


class DriverUnavailableError(WeightpullError, ImportError):
    """The driver is known but cannot load here; the message names the missing extra."""


# -- replicas: update agent, apply, dispatch -----------------------------------------------


class ApplyError(WeightpullError):
    """Loading a pulled version into an engine's weights failed. The replica was given
    back the last good version (`restored`) and may serve it again, or, if even that
    failed, it holds no defined weights (`restored` is None), stays paused and must not
    serve. The cause (`__cause__`) names what did not load."""

    def __init__(self, message: str, *, version: int, restored: int | str | None) -> None:
        super().__init__(message)
        self.version, self.restored = version, restored


class IncompleteApplyError(WeightpullError):
    """An apply did not reach every weight the engine computes with: a layer got none or
    only some of its weights (it would keep the previous version's), a published tensor
    loaded nowhere, or tied tensors were published with different bytes. Names them."""


class ApplyCheckError(WeightpullError):
    """The check after an apply found tensors the engine's kernels use whose bytes differ
    from what the same loading makes of the pulled copy. Names them."""


class UnsupportedModelError(WeightpullError):
    """An engine's model cannot be updated in place whole; refused at start-up."""


class AgentFailedError(WeightpullError):
    """A replica's update agent stopped on an error; what waited on it fails with this,
    chained to the cause, instead of waiting forever."""


class NoProducerError(WeightpullError):
    """Every producer a trainer's sample waits on has died, failed or gone silent: the
    sample would never come. The message names each one and what became of it."""


class StaleSampleError(WeightpullError):
    """A training sample held a group older than the staleness bound allows."""

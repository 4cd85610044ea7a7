"""Source choice: which holder of a version a reader should read it from.

A version may be read from its publisher's slot (the *origin*) or from any replica that
holds it in a mirror it offers as a *relay*. The registry hands each reader one source,
chosen by `choose_source`, a pure function of what the registry knows when the reader
asks: every source of the version (its host, its live leases, its cap, whether it is
alive) and the reader's host. The rules, in order:

1. never a source that is gone (its liveness lapsed), full (as many live leases as its
   cap), excluded by the reader (one that failed it mid-read), or the reader itself;
2. prefer a source on the reader's own host: its bytes cross no network link;
3. then the fewest live leases, so load spreads and every source's link stays busy;
4. then the fewest hops from the origin (a relay that reads from a relay is further
   from the origin's bytes, and forwards them later when a version streams);
5. then the name, so the choice is the same wherever it is made.

What shape this grows depends on when relays offer themselves. Readers that ask one
after another, each offering itself as soon as it leases, make a chain (the newest relay
is the idle one): every link carries the bytes once, and with buckets forwarded as they
arrive the time until N serve grows by one bucket's hop per replica. Readers that all ask
at once, relays offering once they hold a bucket, with a cap of k on every source, make
a k-ary tree: log_k(N) hops, each link shared k ways. Either beats N reads from one link.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from .errors import InvalidArgumentError, NoSourceError


def _check_name(what: str) -> Any:
    def check(_: Any, __: Any, value: object) -> None:
        if not isinstance(value, str) or not value:
            raise InvalidArgumentError(f"{what} must be a non-empty string, got {value!r}")

    return check


def _check_count(what: str) -> Any:
    def check(_: Any, __: Any, value: object) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidArgumentError(f"{what} must be a non-negative int, got {value!r}")

    return check


def _check_cap(_: Any, __: Any, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InvalidArgumentError(f"a source's cap must be a positive int or None (no cap), got {value!r}")


@attrs.frozen
class Source:
    """One holder of a version, as the registry sees it when a reader asks.

    Attributes:
        name: The principal that serves it.
        host: The host it is on.
        leases: Its live leases.
        cap: The most live leases it takes at once; None: no cap.
        alive: False once its liveness lapsed: its offers are gone.
        hops: 0 for the origin's slot, else relays between it and the origin, plus one.

    Raises:
        InvalidArgumentError: An empty name or host, a negative count, or a cap below 1.
    """

    name: str = attrs.field(validator=_check_name("a source's name"))  # the principal that serves it
    host: str = attrs.field(validator=_check_name("a source's host"))
    leases: int = attrs.field(default=0, validator=_check_count("a source's live leases"))
    cap: int | None = attrs.field(default=None, validator=_check_cap)  # most live leases at once; None: no cap
    alive: bool = True  # False once its liveness lapsed: its offers are gone
    hops: int = attrs.field(default=0, validator=_check_count("a source's hops"))  # 0: the origin's slot

    @property
    def full(self) -> bool:
        """Whether it holds as many live leases as its cap."""
        return self.cap is not None and self.leases >= self.cap

    @property
    def is_relay(self) -> bool:
        """Whether it is a relay's mirror, not the origin's slot."""
        return self.hops > 0


@attrs.frozen
class Reader:
    """Who asks for a source: its name (never its own source) and its host.

    Raises:
        InvalidArgumentError: An empty name or host.
    """

    name: str = attrs.field(validator=_check_name("a reader's name"))
    host: str = attrs.field(validator=_check_name("a reader's host"))


def _check_unique(sources: Sequence[Source]) -> None:
    seen: set[str] = set()
    for s in sources:
        if not isinstance(s, Source):
            raise InvalidArgumentError(f"sources must be Source records, got {s!r}")
        if s.name in seen:
            raise InvalidArgumentError(f"source {s.name!r} is listed twice")
        seen.add(s.name)


def eligible(sources: Iterable[Source], reader: Reader, exclude: Iterable[str] = ()) -> list[Source]:
    """The sources `reader` may be handed: alive, not full, not excluded, not itself."""
    excluded = set(exclude)
    return [s for s in sources if s.alive and not s.full and s.name not in excluded and s.name != reader.name]


def rank(source: Source, reader: Reader) -> tuple[bool, int, int, str]:
    """The order of preference among eligible sources: lowest first."""
    return (source.host != reader.host, source.leases, source.hops, source.name)


def choose_source(sources: Iterable[Source], reader: Reader, *, exclude: Iterable[str] = ()) -> Source:
    """The source `reader` should lease its version at (the rules in the module's doc).

    Args:
        sources: Every holder of the version.
        reader: Who asks.
        exclude: Names of sources the reader will not be handed (one that failed it).

    Returns:
        The eligible source ranked first.

    Raises:
        NoSourceError: None is eligible; its message says whether every live source is
            full (ask again when a lease ends) or none is left alive.
        InvalidArgumentError: `reader` is not a `Reader`, `exclude` is a string, or a
            source is not a `Source` or is listed twice.
    """
    if not isinstance(reader, Reader):
        raise InvalidArgumentError(f"reader must be a Reader, got {reader!r}")
    if isinstance(exclude, str):
        raise InvalidArgumentError(f"exclude must be a collection of source names, not the string {exclude!r}")
    listed = list(sources)
    _check_unique(listed)
    excluded = set(exclude)
    candidates = eligible(listed, reader, excluded)
    if candidates:
        return min(candidates, key=lambda s: rank(s, reader))
    others = [s for s in listed if s.name != reader.name and s.name not in excluded]
    live = [s for s in others if s.alive]
    if not others:
        why = "it has no source" if not listed else "every source is excluded or is the reader itself"
    elif not live:
        why = "every source is gone (liveness lapsed)"
    else:
        why = f"every live source is full ({', '.join(f'{s.name} {s.leases}/{s.cap}' for s in live)}); ask again"
    raise NoSourceError(f"no source for reader {reader.name!r} on host {reader.host!r}: {why}")

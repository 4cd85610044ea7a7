"""A reader's connections to the memory it reads (publishers' slots, relays' mirrors):
one per descriptor, made once and reused across pulls, dropped when what is behind it
is gone, all closed with the reader."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator

import anyio

from .errors import WeightpullError
from .transport import Remote, Transport

__all__ = ["Connections"]

log = logging.getLogger(__name__)


class Connections:
    """Connections of `transport`, by slot descriptor, the least recently used dropped
    past `most` (None: never).

    Args:
        transport: The driver that connects.
        most: How many to keep at the most; never fewer than a call's `keep`.
    """

    def __init__(self, transport: Transport, most: int | None = None) -> None:
        self.transport, self.most = transport, most
        self._remotes: OrderedDict[bytes, Remote] = OrderedDict()

    def get(self, descriptor: bytes, keep: int = 1) -> Remote:
        """The connection to `descriptor`, made once, not once per pull; never dropping
        one of the `keep` used last (a sharded pull uses one per shard)."""
        remote = self._remotes.get(descriptor)
        if remote is None:
            remote = self._remotes[descriptor] = self.transport.connect(descriptor)
            if self.most is not None and len(self._remotes) > max(self.most, keep):
                self.transport.disconnect(self._remotes.popitem(last=False)[1])
        self._remotes.move_to_end(descriptor)
        return remote

    async def map_ahead(self, descriptors: list[bytes], device: str, holder: str) -> int:
        """Connect to each of `descriptors` (reserved slots) and map it for `device` now,
        so the first pull pays neither; one that cannot be mapped is logged and left to
        that pull. Returns how many were mapped."""
        mapped = 0
        for descriptor in descriptors:
            try:
                remote = self.get(descriptor, keep=len(descriptors))
                await anyio.to_thread.run_sync(self.transport.prepare, remote, device)
            except WeightpullError as exc:
                log.warning("%s: could not map a reserved slot ahead: %s", holder, exc)
                continue
            mapped += 1
        return mapped

    def forget(self, descriptors: Iterable[bytes]) -> None:
        """Disconnect from each of `descriptors`: the memory or peer behind them is gone
        or stuck, so the next read connects afresh."""
        for descriptor in descriptors:
            remote = self._remotes.pop(descriptor, None)
            if remote is not None:
                self.transport.disconnect(remote)

    def close(self) -> None:
        """Disconnect from every one."""
        self.forget(list(self._remotes))

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._remotes)

    def __len__(self) -> int:
        return len(self._remotes)

"""A reader's connections to the memory it reads (publishers' slots, relays' mirrors):
one per descriptor, made once and reused across pulls, dropped when what is behind it
is gone, all closed with the reader."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from .transport import Remote, Transport

__all__ = ["Connections"]


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

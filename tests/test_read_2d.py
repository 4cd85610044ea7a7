"""2-D reads: faults cut a read at byte counts, and `row_runs` maps the cuts back onto rows."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightpull.drivers.fake import FakeFabric, FakeTransport
from weightpull.drivers.faulty import Faults, FaultyTransport, row_runs
from weightpull.errors import TransportError


@given(st.integers(1, 9), st.integers(0, 60), st.integers(0, 60))
def test_row_runs_cover_the_bytes_asked_in_order_and_nothing_else(width, a, b):
    start, stop = min(a, b), max(a, b)
    covered = [
        (row + i) * width + col + k
        for row, col, n, rows in row_runs(width, start, stop)
        for i in range(rows)
        for k in range(n)
    ]
    assert covered == list(range(start, stop))
    assert all(0 <= col and col + n <= width for _, col, n, _ in row_runs(width, start, stop))


@pytest.mark.parametrize("faults", [Faults(), Faults(bandwidth=1e9), Faults(fail_reads=1)])
def test_a_faulted_2d_read_lands_every_row_or_fails_naming_the_fault(faults):
    async def main() -> None:
        fabric = FakeFabric()
        owner, reader = FakeTransport(fabric=fabric), FakeTransport(fabric=fabric)
        data = bytes(range(256)) * 64
        remote = reader.connect(owner.export(owner.register(bytearray(data))))
        mine = bytearray(4096)
        local = reader.register(mine)
        faulty = FaultyTransport(reader, faults)
        assert faulty.native_2d  # the fake's
        if faults.fail_reads:
            with pytest.raises(TransportError, match="injected failure"):
                await faulty.read_2d(remote, 3, 256, local, 0, 100, 100, 20)
            return
        await faulty.read_2d(remote, 3, 256, local, 0, 100, 100, 20)
        assert bytes(mine[:2000]) == b"".join(data[3 + i * 256 : 103 + i * 256] for i in range(20))
        assert faults.reads == 1  # one read, faulted once, not one per row

    anyio.run(main)

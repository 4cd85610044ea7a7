"""Testing aids, shipped: what weightpull's own tests stand on, for users' tests and for
third-party drivers.

- `FakeClock`: time that moves only when told to (`advance`, `autojump`), so protocol
  tests never sleep.
- `FakeTransport`, `FakeFabric`: the in-process driver ("fake"); `FaultyTransport`,
  `Faults`: torn, failing, slow or frozen reads around any driver.
- `conformance`: each driver's `Kit` for the conformance suite, and `kit_for(name)`;
  `conformance_suite`: the suite itself, which a third-party driver registered under the
  `weightpull.transports` entry points runs as
  `WEIGHTPULL_DRIVERS=mydriver pytest --pyargs weightpull.drivers.testing.conformance_suite`.
"""

from weightpull.clock import FakeClock

from ..fake import FakeFabric, FakeTransport
from ..faulty import Faults, FaultyTransport

__all__ = ["FakeClock", "FakeFabric", "FakeTransport", "Faults", "FaultyTransport"]

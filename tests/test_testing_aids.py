"""The testing aids weightpull ships (`weightpull.drivers.testing`): a third-party driver,
installed with its entry points, runs the same conformance suite the built-in drivers pass."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from weightpull.drivers.testing import FakeClock, FakeTransport, Faults, FaultyTransport
from weightpull.drivers.testing.conformance import KITS, kit_for

DRIVER = '''
from weightpull.drivers.fake import FakeFabric, FakeTransport
from weightpull.drivers.testing.conformance import InProcessPeer, Kit, fake_kit

FABRIC = FakeFabric()


class MemCopyTransport(FakeTransport):
    """A third party's driver (here the fake one under another name)."""

    def __init__(self, **options):
        super().__init__(fabric=FABRIC, **options)


def kit():
    base = fake_kit()
    return Kit("memcopy", MemCopyTransport, lambda: InProcessPeer(MemCopyTransport()),
               lambda t, region: region.handle in t.fabric.regions, base.widen)
'''


def test_a_third_party_driver_runs_the_conformance_suite(tmp_path):
    (tmp_path / "memcopy_driver.py").write_text(textwrap.dedent(DRIVER))
    info = tmp_path / "memcopy_driver-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: memcopy-driver\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[weightpull.transports]\nmemcopy = memcopy_driver:MemCopyTransport\n\n"
        "[weightpull.conformance_kits]\nmemcopy = memcopy_driver:kit\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "WEIGHTPULL_DRIVERS": "memcopy"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--pyargs",
            "weightpull.drivers.testing.conformance_suite",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    from weightpull.drivers.testing import conformance_suite

    tests = sum(name.startswith("test_") for name in vars(conformance_suite))  # each runs once, for its one driver
    assert f"{tests} passed" in run.stdout and "skipped" not in run.stdout


def test_kits_of_built_in_drivers_are_whole_and_an_unknown_driver_gets_a_generic_one():
    for name in KITS:
        kit = KITS[name]()
        assert kit.holds is not None and kit.widen is not None, name  # none of their tests skips
        kit.close()
    generic = kit_for("no-such-kit")
    assert generic.name == "no-such-kit" and generic.holds is None and generic.widen is None


def test_the_aids_are_the_ones_the_project_tests_with():
    clock = FakeClock()
    clock.advance(2.5)
    assert clock.now() == 2.5
    faulty = FaultyTransport(FakeTransport(), Faults(fail_reads=1))
    assert faulty.faults.fail_reads == 1

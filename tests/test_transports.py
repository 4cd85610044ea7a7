import subprocess
import sys
import textwrap

import pytest

from weightpull import Transport, create_transport, list_transports, register_transport
from weightpull.drivers.fake import FakeTransport
from weightpull.errors import DriverUnavailableError, UnknownDriverError
from weightpull.transports import _registered


@pytest.fixture(autouse=True)
def clean_registry():
    yield
    _registered.clear()


def test_builtin_fake_is_listed_and_loads():
    infos = {i.name: i for i in list_transports()}
    assert infos["fake"].available and infos["fake"].origin == "builtin"
    assert isinstance(create_transport("fake"), FakeTransport)


def test_unknown_driver_lists_known_ones():
    with pytest.raises(UnknownDriverError, match="known: .*fake"):
        create_transport("carrier-pigeon")


def test_a_driver_that_cannot_import_names_its_extra():
    register_transport("ghost", "weightpull_no_such_module:Ghost", extra="ghost")
    with pytest.raises(DriverUnavailableError, match=r"pip install 'weightpull\[ghost\]'"):
        create_transport("ghost")
    (info,) = [i for i in list_transports() if i.name == "ghost"]
    assert not info.available and "weightpull[ghost]" in info.reason


def test_a_driver_can_report_itself_unavailable():
    class NeedsGpu(FakeTransport):
        @classmethod
        def unavailable_reason(cls):
            return "no CUDA device"

    register_transport("gpu-only", NeedsGpu)
    with pytest.raises(DriverUnavailableError, match="no CUDA device"):
        create_transport("gpu-only")


def test_register_refuses_duplicates_and_non_transports():
    with pytest.raises(ValueError, match="already"):
        register_transport("fake", FakeTransport)
    register_transport("not-one", "weightpull.errors:WeightpullError")
    with pytest.raises(DriverUnavailableError, match="not a Transport"):
        create_transport("not-one")


def test_third_party_drivers_load_through_entry_points(tmp_path):
    """A real installed distribution's entry point, discovered in a fresh interpreter."""
    (tmp_path / "acme_transport.py").write_text(
        textwrap.dedent("""
        from weightpull.drivers.fake import FakeTransport
        class AcmeTransport(FakeTransport):
            name = "acme"
    """)
    )
    dist = tmp_path / "acme_transport-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-transport\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[weightpull.transports]\nacme = acme_transport:AcmeTransport\n")
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(tmp_path)!r})
        from weightpull import create_transport, list_transports
        info = [i for i in list_transports() if i.name == "acme"][0]
        print(info.origin, info.available, type(create_transport("acme")).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["entry", "point", "(acme-transport)", "True", "AcmeTransport"]


def test_transport_is_abstract():
    with pytest.raises(TypeError):
        Transport()

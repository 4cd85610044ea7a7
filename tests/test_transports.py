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


def test_the_built_in_drivers_are_listed_as_before_they_were_entry_points():
    """The built-ins come from weightpull's entry points now; what list_transports says of
    them is what it said when they were a table in the core."""
    infos = {i.name: (i.origin, i.target, i.extra) for i in list_transports()}
    assert infos == {
        "cuda_ipc": ("builtin", "weightpull.drivers.cuda_ipc:CudaIpcTransport", "torch"),
        "fake": ("builtin", "weightpull.drivers.fake:FakeTransport", None),
        "nixl": ("builtin", "weightpull.drivers.nixl:NixlTransport", "nixl"),
        "torch": ("builtin", "weightpull.drivers.torch_transport:TorchTransport", "torch-transport"),
    }
    for info in list_transports():  # each loads as it did: available, or saying why not
        assert info.available == (info.reason is None)


def test_the_old_tables_of_the_driver_registry_are_made_from_the_entry_points():
    from weightpull import transports

    assert transports.BUILTIN["nixl"] == transports.DriverEntry(
        "nixl", "weightpull.drivers.nixl:NixlTransport", extra="nixl"
    )
    assert transports.HOST_STAGING == transports.DriverEntry(
        "host staging", "weightpull.integrations.torch_staging:HostStaged", extra="torch"
    )


def test_a_third_partys_entry_point_does_not_shadow_a_built_in(tmp_path):
    (tmp_path / "evil_transport.py").write_text("class Evil: pass\n")
    dist = tmp_path / "evil_transport-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: evil-transport\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[weightpull.transports]\nfake = evil_transport:Evil [evil]\n")
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(tmp_path)!r})
        from weightpull import create_transport, list_transports
        (info,) = [i for i in list_transports() if i.name == "fake"]
        print(info.origin, info.target, type(create_transport("fake")).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["builtin", "weightpull.drivers.fake:FakeTransport", "FakeTransport"]

"""The plugin registry: what the core loads at run time, found through entry points."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from importlib.metadata import PackageNotFoundError

import pytest

from weightpull import plugins
from weightpull.errors import DriverUnavailableError, InvalidArgumentError
from weightpull.layout import TensorSpec, plan_layout
from weightpull.tensors import as_tensors

GROUPS = (
    plugins.TRANSPORTS,
    plugins.TENSOR_ADAPTERS,
    plugins.TENSOR_VIEWS,
    plugins.HOST_STAGING,
    plugins.DIGESTERS,
    plugins.REGISTRY_CLIENTS,
    plugins.MOVED,
)


@pytest.fixture
def fresh_metadata():
    plugins.refresh()
    yield
    plugins.refresh()


def test_every_built_in_names_a_module_that_is_there():
    for group in GROUPS:
        built_in = [p for p in plugins.plugins(group).values() if p.builtin]
        assert built_in, f"weightpull declares nothing in {group}"
        for plugin in built_in:
            module = plugin.target.partition(":")[0]
            parent = module.rpartition(".")[0]
            # Found without importing it (a driver's library may be missing here).
            assert importlib.util.find_spec(parent) is not None and importlib.util.find_spec(module) is not None, plugin


def test_a_built_ins_extras_are_read_as_written():
    torch_driver = plugins.builtin(plugins.TRANSPORTS, "torch")
    assert torch_driver.extras == ("torch-transport",) and torch_driver.extra == "torch-transport"
    assert plugins.builtin(plugins.REGISTRY_CLIENTS, "tcp").extra == "service"
    assert plugins.builtin(plugins.MOVED, "cli").extra is None


def test_a_plugin_that_cannot_import_names_the_extra_to_install():
    ghost = plugins.Plugin(plugins.DIGESTERS, "ghost", "weightpull_no_such_module:f", ("torch",), "weightpull")
    with pytest.raises(
        DriverUnavailableError, match=r"the ghost digester cannot load: .*pip install 'weightpull\[torch\]'"
    ):
        plugins.load(ghost, "the ghost digester")
    theirs = plugins.Plugin(plugins.DIGESTERS, "ghost", "weightpull_no_such_module:f", ("acme",), "acme-digests")
    with pytest.raises(DriverUnavailableError) as caught:
        plugins.load(theirs)
    assert "pip install" not in str(caught.value)  # a third party's extras are its own, not weightpull's
    missing = plugins.Plugin(plugins.DIGESTERS, "ghost", "weightpull.digests:no_such_function", (), "weightpull")
    with pytest.raises(DriverUnavailableError, match="weightpull.digests:no_such_function not found"):
        plugins.load(missing)


def test_without_weightpulls_metadata_the_error_says_to_install_it(monkeypatch, fresh_metadata):
    def not_installed(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(plugins, "distribution", not_installed)
    with pytest.raises(plugins.MetadataMissingError, match=r"pip install -e \."):
        plugins.plugins(plugins.TRANSPORTS)
    from weightpull import list_transports

    with pytest.raises(plugins.MetadataMissingError, match="metadata is not installed"):
        list_transports()


def test_metadata_older_than_the_code_says_to_reinstall():
    with pytest.raises(plugins.MetadataMissingError, match=r"names no 'nope' .*reinstall it .*pip install -e \."):
        plugins.builtin(plugins.HOST_STAGING, "nope")


def test_a_named_plugin_is_shown_by_its_dotted_name():
    named = plugins.Named(plugins.DIGESTERS, "torch")
    assert f"digester={named}" == "digester=weightpull.integrations.torch_digests.wsum64_digests"
    assert "'nope'" in str(plugins.Named(plugins.DIGESTERS, "nope"))


def test_views_of_a_framework_nobody_installed_are_refused():
    with pytest.raises(InvalidArgumentError, match=r"no tensor views for 'jax' .*known: torch"):
        as_tensors(plan_layout([TensorSpec("w", "float32", (2,))]), None, framework="jax")


def test_a_third_partys_tensor_adapter_is_found_by_its_tensors_module(tmp_path):
    """A framework's tensors publish through the adapter its distribution declares, named by
    the top-level module of the tensors' type; the core names no framework."""
    (tmp_path / "acme_tensors.py").write_text(
        textwrap.dedent("""
        class Tensor:
            pass

        class Adapter:
            pass
        """)
    )
    dist = tmp_path / "acme_tensors-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-tensors\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[weightpull.tensor_adapters]\nacme_tensors = acme_tensors:Adapter\n")
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(tmp_path)!r})
        import acme_tensors
        from weightpull.tensors import adapter_for
        print(type(adapter_for(acme_tensors.Tensor())).__qualname__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["Adapter"]


def test_a_value_of_no_known_framework_is_refused():
    from weightpull.tensors import adapter_for

    with pytest.raises(InvalidArgumentError, match="cannot publish a builtins.bytes"):
        adapter_for(b"raw")

"""The layers hold: the core imports no driver or integration, not even by an import
string, and drivers import no integration (import-linter's contracts in pyproject.toml,
run as the test run's gate; the core's contract type is tests/contracts.py); the core's
contract covers every module of the core, and both break on an injected violation of each kind."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "import-linter is in the dev extra: make setup"
    env = {**os.environ, "COLUMNS": "400", "PYTHONPATH": str(ROOT)}  # one line per finding; tests.contracts
    return subprocess.run([lint, "--no-cache", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def core_contract() -> dict:
    (core,) = [c for c in contracts() if c["name"].startswith("the core")]
    return core


def test_import_linter_contracts_are_kept():
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert f"{len(contracts())} kept, 0 broken" in run.stdout


def test_the_core_contract_covers_every_module_of_the_core():
    grimp = pytest.importorskip("grimp")
    from tests.contracts import ForbiddenEvenByStringContract

    # The options as lint-imports reads them (TOML's booleans as strings).
    options = {k: str(v) if isinstance(v, bool) else v for k, v in core_contract().items()}
    contract = ForbiddenEvenByStringContract(options["name"], {"root_packages": ["weightpull"]}, options)
    files = [p.relative_to(ROOT / "core").with_suffix("") for p in (ROOT / "core").rglob("*.py")]
    modules = {".".join(("weightpull", *(f.parts[:-1] if f.name == "__init__" else f.parts))) for f in files}
    assert set(contract.sources(grimp.build_graph("weightpull", cache_dir=None))) == modules


def test_a_string_naming_a_forbidden_module_is_told_from_prose():
    from tests.contracts import names_pattern, strings_naming

    pattern = names_pattern(core_contract()["forbidden_modules"])
    source = """
import importlib
importlib.import_module("weightpull.integrations.cli")
TARGETS = ["weightpull.drivers.nixl:NixlTransport", "weightpull.drivers", "weightpull.drivers.nixl:NixlTransport [nixl]"]
f"{1}weightpull.integrations.torch_digests.wsum64_digests"
MESSAGE = "weightpull.cli moved to weightpull.integrations.cli; the old name goes"
OTHERS = ["weightpull.driverless", "weightpull.tensors:as_tensors", "weightpull.drivers.nixl is slow"]
"""
    assert [line for line, _ in strings_naming(source, pattern)] == [3, 4, 4, 4, 5]


def copy_of_the_package(where: Path) -> Path:
    """The package laid out as it is imported (`weightpull`, `.drivers`, `.integrations`)."""
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "core", where / "weightpull", ignore=skip)
    shutil.copytree(ROOT / "drivers", where / "weightpull" / "drivers", ignore=skip)
    shutil.copytree(ROOT / "integrations", where / "weightpull" / "integrations", ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", where / "pyproject.toml")
    return where


def test_the_contracts_break_on_an_import_by_string_and_on_an_import_statement(tmp_path):
    tree = copy_of_the_package(tmp_path)
    assert lint_imports(tree).returncode == 0  # the copy as it is keeps the contracts
    core = tree / "weightpull" / "tensors.py"
    lines = core.read_text().count("\n")
    with core.open("a") as f:
        f.write('\n\ndef _injected():\n    return importlib.import_module("weightpull.integrations.cli")\n')
        f.write("\n\nimport weightpull.drivers.nixl  # noqa: E402\n")
    driver = tree / "weightpull" / "drivers" / "fake.py"
    driver_lines = driver.read_text().count("\n")
    driver.write_text(driver.read_text() + 'MAIN = "weightpull.integrations.cli:main"\n')
    run = lint_imports(tree)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    assert f"{len(contracts()) - 2} kept, 2 broken" in run.stdout
    assert re.search(rf"weightpull\.tensors -> weightpull\.drivers\.nixl \(l\.{lines + 7}\)", run.stdout), run.stdout
    assert (
        f"weightpull/tensors.py:{lines + 4}: weightpull.tensors names 'weightpull.integrations.cli' by a string"
        in run.stdout
    ), run.stdout
    assert (
        f"weightpull/drivers/fake.py:{driver_lines + 1}: weightpull.drivers.fake names "
        "'weightpull.integrations.cli:main' by a string" in run.stdout
    ), run.stdout


def test_the_cli_and_the_demo_keep_their_old_names_for_a_release():
    import warnings

    import pytest

    from weightpull.integrations import cli, demo

    with pytest.warns(DeprecationWarning, match="weightpull.integrations.cli"):
        from weightpull.cli import main
    assert main is cli.main
    with pytest.warns(DeprecationWarning, match="weightpull.integrations.demo"):
        from weightpull.demo import Progress
    assert Progress is demo.Progress
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names do not warn
        from weightpull.integrations.cli import main as new_main  # noqa: F401


def test_the_benches_old_module_paths_forward_for_a_release():
    import pytest

    from weightpull.integrations.bench import pull, registry, util

    with pytest.warns(DeprecationWarning, match="weightpull.integrations.bench.pull"):
        from weightpull.bench import BenchConfig, parse_size
    assert BenchConfig is pull.BenchConfig and parse_size is util.parse_size
    with pytest.warns(DeprecationWarning, match="weightpull.integrations.bench.registry"):
        from weightpull.drivers.zmq_registry.bench import run_bench
    assert run_bench is registry.run_bench

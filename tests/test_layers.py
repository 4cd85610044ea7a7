"""The layers hold: the core imports no driver or integration, drivers import no
integration (import-linter's contracts in pyproject.toml, run as the test run's gate),
and the contract names every module of the core."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_are_kept():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "import-linter is in the dev extra: make setup"
    run = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "2 kept, 0 broken" in run.stdout


def test_the_core_contract_names_every_module_of_the_core():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (core,) = [c for c in config["contracts"] if c["name"].startswith("the core")]
    modules = {"weightpull" if p.stem == "__init__" else f"weightpull.{p.stem}" for p in (ROOT / "core").glob("*.py")}
    assert set(core["source_modules"]) == modules


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

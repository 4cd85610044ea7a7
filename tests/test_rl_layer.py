"""The RL loop is a layer of its own (`weightpull.rl`) on the protocol: its old module paths
forward for a release with a `DeprecationWarning` naming the new one, the project itself
uses the new ones, and nothing of the protocol imports the loop (an import contract that
is shown to bite)."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MOVED = ("agent", "dispatcher", "health", "ledger", "replay", "staleness")


@pytest.mark.parametrize("module", MOVED)
def test_an_old_module_path_forwards_to_the_same_objects_with_a_warning(module):
    new = importlib.import_module(f"weightpull.rl.{module}")
    old = importlib.import_module(f"weightpull.{module}")
    public = [
        n for n, v in vars(new).items() if not n.startswith("_") and getattr(v, "__module__", None) == new.__name__
    ]
    assert public, module
    for name in public:
        with pytest.warns(DeprecationWarning, match=rf"weightpull\.{module} moved to weightpull\.rl\.{module}"):
            assert getattr(old, name) is getattr(new, name)


def test_from_an_old_path_gives_the_class_of_the_new_one():
    from weightpull.rl.agent import UpdateAgent as new

    with pytest.warns(DeprecationWarning, match="weightpull.rl.agent"):
        from weightpull.agent import UpdateAgent
    assert UpdateAgent is new


def test_an_old_path_has_no_name_the_new_one_lacks():
    import weightpull.ledger as old

    with pytest.raises(AttributeError), pytest.warns(DeprecationWarning):
        old.NoSuchName  # noqa: B018


def test_the_project_imports_the_loop_without_a_deprecation_warning():
    code = "import weightpull, weightpull.rl, weightpull.integrations.loop, weightpull.integrations.vllm"
    subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], check=True, timeout=120)


def _lint(config: Path) -> subprocess.CompletedProcess[str]:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "import-linter is in the dev extra: make setup"
    return subprocess.run(
        [lint, "--no-cache", "--config", str(config), "--contract", "rl-layer"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _contract() -> dict:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"] == "the protocol imports no RL loop"]
    return contract


def _config(allowed: list[str]) -> str:
    """The contract alone, as pyproject.toml has it, but for its allowed importers."""
    contract = _contract()
    quoted = ", ".join(f'"{m}"' for m in allowed)
    protected = ", ".join(f'"{m}"' for m in contract["protected_modules"])
    return (
        '[tool.importlinter]\nroot_package = "weightpull"\n\n[[tool.importlinter.contracts]]\n'
        f'id = "rl-layer"\nname = "{contract["name"]}"\ntype = "{contract["type"]}"\n'
        f"as_packages = {str(contract['as_packages']).lower()}\n"
        f"protected_modules = [{protected}]\nallowed_importers = [{quoted}]\n"
    )


def test_the_protocol_contract_is_kept_and_bites(tmp_path):
    allowed = _contract()["allowed_importers"]
    config = tmp_path / "contract.toml"
    config.write_text(_config(allowed))
    kept = _lint(config)
    assert kept.returncode == 0, kept.stdout[-3000:] + kept.stderr[-2000:]
    # The top level re-exports the loop: were it a protocol module, the contract breaks.
    config.write_text(_config([m for m in allowed if m != "weightpull"]))
    broken = _lint(config)
    assert broken.returncode != 0
    assert "weightpull -> weightpull.rl" in broken.stdout, broken.stdout[-3000:]

"""The top level is a face a user can learn: `__all__` holds what a user writes and the
errors a user catches most, and nothing else public; every other name it held in 0.1
still resolves there for one release, to the same object, with a `DeprecationWarning`
naming where it lives now; the project itself imports no name from its old place."""

from __future__ import annotations

import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

import weightpull
import weightpull.errors
import weightpull.rl

ROOT = Path(__file__).resolve().parents[1]

# The top level of 0.1, every name of which must keep resolving for a release.
TOP_LEVEL_0_1 = """
AgentFailedError ApplyCheckError ApplyError AuthenticationError Bucket Clock connect_registry create_transport
DigestMismatchError Dispatcher DriverUnavailableError EngineControl FakeClock Group HostTensor IncompleteApplyError
InProcessRegistry InvalidArgumentError InvalidTransitionError Layout Lease LeaseExpiredError LeaseNotFoundError
LeaseState list_transports MalformedMessageError Manifest MessageTooLargeError MonotonicClock NoFreeSlotError
NoProducerError NoProgressError NoReadyVersionError PauseMode PeerGoneError PermissionDeniedError Placement
plan_layout plan_slice Principal Prompt ProtocolError Publisher PublishError PublishResult Pulled Puller PullError
RankSlice Region RegionNotRegisteredError register_transport Registry RegistryError RegistryStatus
RegistryUnavailableError Remote ReplayedMessageError Role Shard Sharding SlicePulled SlicePuller SlotState
SlotWaitTimeoutError StalenessClock StaleSampleError TensorAdapter TensorSpec TornReadError Trajectory Transport
TransportError UnknownDriverError UnsupportedModelError UpdateAgent VersionInUseError VersionNotFoundError
VersionOrderError VersionState VersionStateError VersionWaitTimeoutError WeightpullError WhenFull NoSourceError
RelayingRegistry
""".split()

MOVED = sorted(set(TOP_LEVEL_0_1) - set(weightpull.__all__))


def _quietly(name: str) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return getattr(weightpull, name)


def test_the_top_level_is_small_and_keeps_few_errors():
    errors = [n for n in weightpull.__all__ if isinstance(_quietly(n), type) and issubclass(_quietly(n), Exception)]
    assert len(weightpull.__all__) <= 60
    assert 10 <= len(errors) <= 13, errors
    assert {"WeightpullError", "TornReadError", "NoReadyVersionError", "PublishError", "PullError"} <= set(errors)


def test_the_registry_protocols_are_all_at_the_top_level():
    from weightpull import registry

    for name in ("Registry", "StreamingRegistry", "ReservingRegistry", "RelayingRegistry"):
        assert _quietly(name) is getattr(registry, name)


@pytest.mark.parametrize("name", sorted(weightpull.__all__))
def test_a_kept_name_does_not_warn(name):
    assert _quietly(name) is not None


@pytest.mark.parametrize("name", MOVED)
def test_a_moved_name_is_the_same_object_with_a_warning_naming_its_place(name):
    home = weightpull._MOVED[name]
    assert isinstance(home, types.ModuleType) and name in vars(home)
    message = rf"weightpull\.{name} moved to {re.escape(home.__name__)}\.{name}; the old name goes in the next release"
    with pytest.warns(DeprecationWarning, match=message):
        found = getattr(weightpull, name)
    assert found is getattr(home, name)


def test_from_import_of_a_moved_name_warns_at_the_importing_line():
    # The import system looks the name up twice for a package: Python's default filter
    # shows one warning a line, at the user's line (not importlib's).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        from weightpull import NoFreeSlotError
    assert NoFreeSlotError is weightpull.errors.NoFreeSlotError
    (warning,) = caught
    assert warning.category is DeprecationWarning and warning.filename == __file__


def test_every_error_lives_in_weightpull_errors():
    for name in [*weightpull.__all__, *MOVED]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            obj = getattr(weightpull, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert getattr(weightpull.errors, name) is obj
            assert obj.__module__ == "weightpull.errors"


def test_every_name_of_0_1_resolves():
    assert len(TOP_LEVEL_0_1) == 86
    assert set(TOP_LEVEL_0_1) <= set(weightpull.__all__) | set(weightpull._MOVED)


def test_all_is_what_the_top_level_offers_without_a_warning():
    public = {n for n, v in vars(weightpull).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public == set(weightpull.__all__)
    assert not set(weightpull._MOVED) & set(dir(weightpull))
    assert len(set(weightpull.__all__)) == len(weightpull.__all__)


def test_an_unknown_name_raises_attribute_error_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="NoSuchName"):
            weightpull.NoSuchName  # noqa: B018
        assert not hasattr(weightpull, "__wrapped__")


def test_star_import_and_the_loop_import_warn_of_nothing():
    code = "from weightpull import *; import weightpull.rl, weightpull.errors; print(len(dir()))"
    run = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr


IMPORT = re.compile(r"^[ \t]*from weightpull import (\([^)]*\)|[^\n]*)", re.M)


def test_the_project_imports_no_moved_name_from_the_top_level():
    tracked = subprocess.run(
        ["git", "ls-files", "*.py", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    offenders = []
    for path in tracked:
        file = ROOT / path
        if not file.exists() or path == "tests/test_public_face.py":
            continue
        for found in IMPORT.finditer(file.read_text()):
            names = {n.split(" as ")[0].strip() for n in re.sub(r"#[^\n]*|[()]", "", found.group(1)).split(",")}
            offenders += [f"{path}: {n}" for n in sorted(names & set(weightpull._MOVED))]
    assert not offenders, "import these from their new module: " + ", ".join(offenders)

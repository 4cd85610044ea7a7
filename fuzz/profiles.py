"""Hypothesis profiles for the fuzzers, picked by $WEIGHTPULL_FUZZ.

`ci` (the default) is bounded and derandomized: the same examples in the same order on
every run, so CI is never flaky, and no example database. `long` (`make fuzz-long`)
explores at random for a time budget, $WEIGHTPULL_FUZZ_MINUTES (30 unless set), and keeps
failing examples in .hypothesis/ to replay. Hypothesis has no time limit of its own, so
each fuzzer runs it in rounds of fresh random examples until its share of the budget is
spent (`fuzz`). Profiles are applied per test, not loaded globally, so tests/ keep
Hypothesis' defaults.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])

settings.register_profile(
    "weightpull-ci", max_examples=600, stateful_step_count=60, derandomize=True, database=None, **_COMMON
)
# One round of the long profile: a few seconds, so a spent budget stops it soon.
settings.register_profile("weightpull-long", max_examples=100, stateful_step_count=120, **_COMMON)

NAME = os.environ.get("WEIGHTPULL_FUZZ", "ci")
try:
    PROFILE = settings.get_profile(f"weightpull-{NAME}")
except Exception:  # hypothesis' InvalidArgument, which names no choices
    raise LookupError(f"WEIGHTPULL_FUZZ={NAME!r}: the profiles are 'ci' (the default) and 'long'") from None
try:
    MINUTES = float(os.environ.get("WEIGHTPULL_FUZZ_MINUTES") or 30)
except ValueError:
    raise LookupError(
        f"WEIGHTPULL_FUZZ_MINUTES={os.environ['WEIGHTPULL_FUZZ_MINUTES']!r} is not a number of minutes"
    ) from None

# The tests that share the long profile's budget; those this session runs that have not
# started yet (fuzz/conftest.py narrows it to those collected); when the budget ends,
# counted from the first one's start.
FUZZERS = ("test_concurrent_actors", "test_protocol", "test_principals", "test_relays", "test_slice_relays")
pending: list[str] = list(FUZZERS)
deadline: float | None = None

# What each fuzzer did, for the summary fuzz/conftest.py prints: rounds, examples, seconds,
# and how often each outcome (harness.note) occurred.
ran: dict[str, dict] = {}
current: str | None = None  # the fuzzer running now


def fuzz(name: str, run: Callable[[settings], None]) -> None:
    """Make the fuzzer `name`'s Hypothesis runs, `run(profile)`: once; under the long
    profile, in rounds until its share of the budget is spent, that share being the
    budget left split evenly among the fuzzers yet to start."""
    global current, deadline
    started = time.monotonic()
    deadline = deadline or started + 60 * MINUTES
    if name in pending:
        pending.remove(name)
    stop = started + (deadline - started) / (len(pending) + 1)
    stats = ran[name] = {"rounds": 0, "examples": 0, "seconds": 0.0, "events": collections.Counter()}
    current = name
    try:
        while True:
            stats["rounds"] += 1
            run(PROFILE)
            if NAME != "long" or time.monotonic() >= stop:
                return
    finally:
        stats["seconds"] = time.monotonic() - started
        current = None


def example() -> None:
    """Count one example of the fuzzer running now."""
    if current is not None:
        ran[current]["examples"] += 1


def event(what: str) -> None:
    if current is not None:
        ran[current]["events"][what] += 1

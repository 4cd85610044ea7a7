"""Hypothesis profiles for the fuzzers, picked by $WEIGHTPULL_FUZZ.

`ci` (the default) is bounded and derandomized: the same examples in the same order on
every run, so CI is never flaky, and no example database. `long` (`make fuzz-long`)
explores at random, far longer, and keeps failing examples in .hypothesis/ to replay.
They are applied per test, not loaded globally, so tests/ keep Hypothesis' defaults.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])

settings.register_profile(
    "weightpull-ci", max_examples=600, stateful_step_count=60, derandomize=True, database=None, **_COMMON
)
settings.register_profile("weightpull-long", max_examples=20_000, stateful_step_count=120, **_COMMON)

NAME = os.environ.get("WEIGHTPULL_FUZZ", "ci")
try:
    PROFILE = settings.get_profile(f"weightpull-{NAME}")
except Exception:  # hypothesis' InvalidArgument, which names no choices
    raise LookupError(f"WEIGHTPULL_FUZZ={NAME!r}: the profiles are 'ci' (the default) and 'long'") from None

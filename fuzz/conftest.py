"""What the fuzzers ran, at the end of the session: the long profile's budget is shared by
the fuzzers collected, and each reports its rounds, examples and time (and, with
--hypothesis-show-statistics, how often each outcome occurred: Hypothesis' own statistics
see only a test decorated with @given, and the fuzzers run @given in rounds inside)."""

from __future__ import annotations

from . import profiles


def pytest_collection_modifyitems(items) -> None:
    collected = {item.name for item in items}
    profiles.pending[:] = [name for name in profiles.FUZZERS if name in collected]


def pytest_terminal_summary(terminalreporter, config) -> None:
    if not profiles.ran:
        return
    budget = f", budget {profiles.MINUTES:g} min" if profiles.NAME == "long" else ""
    terminalreporter.section(f"fuzzing: profile {profiles.NAME}{budget}")
    for name, ran in profiles.ran.items():
        terminalreporter.write_line(
            f"{name}: {ran['examples']:,} examples in {ran['rounds']} round(s), {ran['seconds'] / 60:.1f} min"
        )
        if config.getoption("--hypothesis-show-statistics"):
            for what, count in sorted(ran["events"].items()):
                terminalreporter.write_line(f"    {count:>9,}  {what}")

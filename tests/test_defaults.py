"""The defaults table (docs/reference/defaults.md) against the code, and the bound the
defaults keep: no reader holding leases blocks a publish longer than it says."""

import argparse
import enum
import inspect
import logging
import re
from pathlib import Path

import anyio
import attrs
import pytest

from weightpull import LeaseSettings, Publisher, Puller, RelaySettings, SlotSettings, WhenFull
from weightpull.errors import SlotWaitTimeoutError
from weightpull.integrations import cli
from weightpull.rl import UpdateAgent
from weightpull.settings import DEFAULT_SKIP_AFTER, DEFAULT_WAIT_TIMEOUT

from .conftest import autojump, host_tensors

PAGE = Path(__file__).parent.parent / "docs" / "reference" / "defaults.md"
SERVE = "weightpull registry serve"


def table() -> dict[str, dict[str, str]]:
    """{where: {parameter: default cell}}, from the page's table."""
    rows: dict[str, dict[str, str]] = {}
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and cells[1].startswith("`"):
            where, name, default = (c.strip("`") for c in cells[:3])
            assert name not in rows.setdefault(where, {}), f"{where} {name} twice"
            rows[where][name] = cells[2]
    return rows


def signature_defaults(cls: type) -> dict[str, object]:
    return {
        name: p.default
        for name, p in inspect.signature(cls).parameters.items()
        if p.default is not inspect.Parameter.empty and p.kind is not inspect.Parameter.VAR_KEYWORD
    }


def field_defaults(*classes: type) -> dict[str, object]:
    return {f.name: f.default for cls in classes for f in attrs.fields(cls)}


def plain(value: object) -> object:
    return value.value if isinstance(value, enum.Enum) else value


def code_value(cell: str) -> object:
    assert cell.startswith("`") and cell.endswith("`"), f"{cell}: a Python default in backticks"
    return eval(cell.strip("`"), {"__builtins__": {}, "None": None, "False": False, "True": True})


def serve_parser() -> argparse.ArgumentParser:
    def sub(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
        (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return action.choices[name]

    return sub(sub(cli.parser(), "registry"), "serve")


@pytest.mark.parametrize(
    ("where", "code"),
    [
        ("Publisher", lambda: {**signature_defaults(Publisher), **field_defaults(SlotSettings)}),
        ("Puller", lambda: {**signature_defaults(Puller), **field_defaults(LeaseSettings, RelaySettings)}),
        ("UpdateAgent", lambda: signature_defaults(UpdateAgent)),
    ],
)
def test_the_table_names_every_default_of_the_class_as_the_code_has_it(where, code):
    documented, defaults = table()[where], code()
    assert sorted(documented) == sorted(defaults), f"{where}: the table's parameters are not the code's"
    for name, default in defaults.items():
        assert code_value(documented[name]) == plain(default), f"{where}({name}=...): {documented[name]}"


def test_the_table_names_every_option_of_registry_serve_as_its_parser_has_it():
    documented = table()[SERVE]
    options = {a.option_strings[-1]: a for a in serve_parser()._actions if a.option_strings and a.dest != "help"}
    assert sorted(documented) == sorted(options)
    for name, action in options.items():
        cell = documented[name]
        if isinstance(action, argparse._StoreTrueAction):
            assert cell == "off", f"{name}: a flag, off by default"
        elif action.default is not None:
            assert cell.strip("`") == str(action.default), f"{name}: {cell}, not {action.default}"
        elif cell != "`None`":  # the effective default, which the option's --help names
            assert f"default: {cell.strip('`')}" in (action.help or ""), f"{name}: {cell} not in its --help"


def test_the_page_is_in_the_nav_and_linked_from_the_readme_and_the_reference():
    root = PAGE.parent.parent.parent
    assert "reference/defaults.md" in (root / "mkdocs.yml").read_text()
    assert "docs/reference/defaults.md" in (root / "README.md").read_text()
    assert "(defaults.md)" in (PAGE.parent / "index.md").read_text()


def test_the_page_states_the_default_bound():
    assert SlotSettings().wait_bound() == DEFAULT_SKIP_AFTER == 1.0
    assert re.search(r"a publish waits for a free slot at most 1 s", PAGE.read_text())


# -- the bound the defaults keep ------------------------------------------------------


async def full(world, pub):
    """Two versions published, the older one leased by a reader that never lets go: every
    slot is kept (v1 leased, v2 the newest)."""
    await pub.publish(1, host_tensors(1))
    await world.registry.acquire(1, ttl=500, holder="slow-replica")
    await pub.publish(2, host_tensors(2))


@pytest.mark.anyio
async def test_with_the_defaults_a_reader_holding_a_lease_blocks_a_publish_no_longer_than_the_bound(world, caplog):
    pub = world.publisher()  # every slot setting at its default
    await full(world, pub)
    async with autojump(world.clock):
        with caplog.at_level(logging.WARNING, logger="weightpull.publisher"):
            for step in (3, 4, 5):
                result = await pub.publish(step, host_tensors(step))
                assert result.skipped and result.slot is None
                assert result.blocked_s == pytest.approx(DEFAULT_SKIP_AFTER, abs=1e-6)
    assert pub.metrics()["publish/skipped"] == 3 and pub.metrics()["publish/failed"] == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 3 and "skipping v3 after waiting 1 s" in warned[0]
    assert "leased by slow-replica" in warned[0] and "num_slots=3" in warned[0]
    assert (await world.registry.newest()).version == 2  # the trainer went on; readers keep v2


@pytest.mark.anyio
async def test_the_default_publishes_once_the_lease_ends_within_the_bound(world):
    pub = world.publisher()
    await pub.publish(1, host_tensors(1))
    lease = await world.registry.acquire(1, ttl=500, holder="r")
    await pub.publish(2, host_tensors(2))

    async def release_soon():
        await world.clock.sleep(0.4)
        await world.registry.release(lease)

    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(release_soon)
        result = await pub.publish(3, host_tensors(3))
    assert not result.skipped and result.slot == 0 and result.blocked_s == pytest.approx(0.4, abs=0.06)


@pytest.mark.anyio
async def test_a_given_wait_timeout_bounds_the_default_wait(world):
    pub = world.publisher(wait_timeout=0.25)
    await full(world, pub)
    async with autojump(world.clock):
        result = await pub.publish(3, host_tensors(3))
    assert result.skipped and result.blocked_s == pytest.approx(0.25, abs=1e-6)


@pytest.mark.anyio
async def test_the_old_explicit_settings_behave_as_before(world):
    waiting = world.publisher(when_full="wait")
    assert waiting.wait_timeout == DEFAULT_WAIT_TIMEOUT == 60.0
    await full(world, waiting)
    async with autojump(world.clock):
        started = world.clock.now()
        with pytest.raises(SlotWaitTimeoutError, match="within 60.0 s"):
            await waiting.publish(3, host_tensors(3))
        assert world.clock.now() - started == pytest.approx(60.0, abs=1e-6)
    skipping = world.publisher(when_full="skip", name="skipper")
    await skipping.publish(10, host_tensors(10))
    await world.registry.acquire(10, ttl=500, holder="r2", publisher="skipper")
    await skipping.publish(11, host_tensors(11))
    result = await skipping.publish(12, host_tensors(12))  # no clock runs: at once
    assert result.skipped and result.blocked_s == 0


def test_the_policy_and_its_bound_are_settings_like_the_rest():
    assert SlotSettings().when_full is WhenFull.WAIT_THEN_SKIP
    assert SlotSettings(when_full="wait").wait_bound() == 60.0
    assert SlotSettings(when_full="wait_then_skip").wait_bound(sharded=True) == 60.0
    assert SlotSettings(wait_timeout=3).wait_bound(sharded=True) == 3

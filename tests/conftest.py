from __future__ import annotations

import os
import time
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from weightpull import FakeClock, HostTensor, InProcessRegistry, Publisher, Puller
from weightpull.drivers.fake import FakeFabric, FakeTransport
from weightpull.tensors import HostTensorAdapter


@pytest.hookimpl(optionalhook=True)  # .venv-verl runs these tests without xdist
def pytest_xdist_make_scheduler(config, log):
    from .scheduling import ByFile  # how the suite is spread, and why

    config.option.loadscopereorder = False  # in collection order, which puts vLLM's first
    return ByFile(config, log)


@pytest.hookimpl(tryfirst=True)  # before pytest's faulthandler copies fd 2
def pytest_configure(config) -> None:
    if hasattr(config, "workerinput"):
        from .scheduling import keep_last_words

        keep_last_words(config.workerinput["workerid"])


def pytest_unconfigure(config) -> None:
    if config.pluginmanager.hasplugin("dsession"):  # the xdist controller
        from .scheduling import forget_last_words

        forget_last_words()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched) -> None:
    """The crashed worker's last words in the failure, not only the test's name."""
    from .scheduling import CRASHES

    words = next((c.last_words for c in reversed(CRASHES) if c.test == crashitem), "")
    report.longrepr = f"{report.longrepr}\n--- the end of its stderr ---\n{words}"


def pytest_terminal_summary(terminalreporter) -> None:
    if terminalreporter.config.pluginmanager.hasplugin("dsession"):
        from .scheduling import report_crashes

        report_crashes(terminalreporter)


def pytest_collection_modifyitems(items) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's collection: vLLM's files first, the tail last
        from .scheduling import queue_key

        items.sort(key=lambda item: queue_key(item.nodeid))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def settle(pulls: Any, timeout: float = 5.0) -> dict:
    """A replica's `BackgroundPulls` status once no pull is pending (blocking; polls)."""
    deadline = time.monotonic() + timeout
    while (status := pulls.status())["pending"] is not None:
        if time.monotonic() > deadline:
            raise AssertionError(f"the pull did not finish: {status}")
        time.sleep(0.01)
    return status


@asynccontextmanager
async def autojump(clock: FakeClock):
    """Let fake time jump whenever every task is blocked, for the body's duration."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(clock.autojump)
        yield
        tg.cancel_scope.cancel()


def host_tensors(version: int, sizes=(1000, 300, 5000)) -> dict[str, HostTensor]:
    """Small uint8 tensors whose bytes derive from the version and the name."""
    return {
        f"t{i}": HostTensor("uint8", (n,), bytes((version * 31 + i * 7 + k) % 251 for k in range(n)))
        for i, n in enumerate(sizes)
    }


class SlowCopy(HostTensorAdapter):
    """Host tensors copied into the slot at `rate` bytes per second of `sleep`'s clock, as a
    trainer's device-to-slot copy runs; from write `fail_at` on (0: the first), the copy
    fails midway with `why`."""

    def __init__(self, rate: float, sleep: Any = anyio.sleep, fail_at: int | None = None, why: str = "") -> None:
        self.rate, self.sleep, self.fail_at, self.why, self.writes = rate, sleep, fail_at, why or "copy failed", 0

    async def write(self, items, region) -> None:
        if self.fail_at is not None and self.writes >= self.fail_at:
            raise RuntimeError(self.why)
        self.writes += 1
        await self.sleep(sum(p.spec.nbytes for _, p in items) / self.rate)
        await super().write(items, region)


class World:
    """A registry, a fabric and helpers to make publishers and pullers on one fake clock."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.registry = InProcessRegistry(self.clock)
        self.fabric = FakeFabric()

    def transport(self, **kw) -> FakeTransport:
        return FakeTransport(clock=self.clock, fabric=self.fabric, **kw)

    def publisher(self, **kw) -> Publisher:
        kw.setdefault("rollout_dtype", None)
        kw.setdefault("bucket_bytes", 2048)
        return Publisher(self.registry, self.transport(), clock=self.clock, **kw)

    def puller(self, transport: FakeTransport | None = None, **kw) -> Puller:
        kw.setdefault("ttl", 5.0)
        return Puller(self.registry, transport or self.transport(), clock=self.clock, **kw)


@pytest.fixture
def world() -> World:
    return World()

"""A discrete-event model of fan-out: how long until N replicas serve a published version.

What it models, per emulated host (one replica per host; a model split across H hosts is
H such slices moving side by side, each its own fan-out, so one slice is simulated):

- **Links.** Every host sends at most `bandwidth` bytes/s; a source's link is shared
  equally by the readers transferring from it at that moment (processor sharing). A
  reader reads from one source, so its own link never binds before its source's does
  when all links are alike.
- **Reads.** A reader reads its buckets in order. Each bucket costs `latency` (the read's
  round trip) plus `bucket_overhead` (posting it, completing it, checking it) during
  which the reader moves no bytes, then its bytes at the reader's share.
- **Publish.** The origin's buckets commit evenly over `publish_s` (a streamed
  publish); 0: all are there when the readers start.
- **Relays.** With `relays`, a replica offers itself as a source of the version once it
  holds its first bucket (`forward`: buckets are forwarded as they arrive, so chains and
  trees pipeline) or once it holds all of them (not `forward`); a reader of a relay reads
  bucket j only after the relay holds it.
- **Source choice.** Every reader asks when the version is announced (t = 0), in turn;
  each gets the source `weightpull.sources.choose_source` picks, or waits and asks
  again when a source offers itself or a lease ends. Live leases are the readers reading
  from a source; a reader releases its lease when its copy is whole.
- **CPUs.** With `cpus`, every host shares that many cores (emulated hosts on one
  machine): each byte moved costs `send_cpu` core-seconds at its source and `recv_cpu`
  at its reader, and a reader that holds its whole copy checks it, `verify_cpu` per byte
  on one core, before it serves. When the demand exceeds the cores, every flow and every
  check slows in the same proportion (processor sharing of the cores, as links are
  shared). Without `cpus` (real hosts, each its own CPUs) the cores never bind; a check
  still takes its time on one core.
- **Failures.** A replica that dies stops reading and serving. Each of its readers
  notices after `detect_s` (at most one lease TTL), drops its whole copy (it never keeps
  bytes of two sources) and asks again, never for the dead one or a replica reading
  from it (directly or not), which would wait on it in a cycle.

Pure: no clock, no I/O; `simulate(scenario)` returns the same `Outcome` every time.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Any

import attrs

from .errors import InvalidArgumentError, NoSourceError
from .sources import Reader, Source, choose_source, rank

_EPS = 1e-12
ORIGIN = "trainer"


def _positive(what: str) -> Any:
    def check(_: Any, __: Any, value: object) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise InvalidArgumentError(f"{what} must be positive, got {value!r}")

    return check


def _count(what: str) -> Any:
    def check(_: Any, __: Any, value: object) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidArgumentError(f"{what} must be a positive int, got {value!r}")

    return check


def _non_negative(what: str) -> Any:
    def check(_: Any, __: Any, value: object) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
            raise InvalidArgumentError(f"{what} must be >= 0, got {value!r}")

    return check


@attrs.frozen
class Failure:
    """Replica `replica` (1-based) dies `at` seconds after the version is announced."""

    replica: int
    at: float = attrs.field(validator=_non_negative("a failure's time"))


def _check_cpus(_: Any, __: Any, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InvalidArgumentError(f"cpus must be a positive int or None, got {value!r}")


def _check_cap(_: Any, __: Any, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InvalidArgumentError(f"cap must be a positive int or None, got {value!r}")


@attrs.frozen
class Scenario:
    replicas: int = attrs.field(validator=_count("replicas"))
    nbytes: int = attrs.field(validator=_count("nbytes"))  # what each host receives
    bucket_bytes: int = attrs.field(validator=_count("bucket_bytes"))
    bandwidth: float = attrs.field(validator=_positive("bandwidth"))  # bytes/s a host sends
    latency: float = attrs.field(default=0.0, validator=_non_negative("latency"))
    bucket_overhead: float = attrs.field(default=0.0, validator=_non_negative("bucket_overhead"))
    publish_s: float = attrs.field(default=0.0, validator=_non_negative("publish_s"))
    relays: bool = False
    forward: bool = True
    cap: int | None = attrs.field(default=None, validator=_check_cap)  # live leases per source
    failures: tuple[Failure, ...] = attrs.field(default=(), converter=tuple)
    detect_s: float = attrs.field(default=1.0, validator=_non_negative("detect_s"))
    cpus: int | None = attrs.field(default=None, validator=_check_cpus)  # cores all hosts share
    send_cpu: float = attrs.field(default=0.0, validator=_non_negative("send_cpu"))  # core-s per byte sent
    recv_cpu: float = attrs.field(default=0.0, validator=_non_negative("recv_cpu"))  # core-s per byte received
    verify_cpu: float = attrs.field(default=0.0, validator=_non_negative("verify_cpu"))  # core-s per byte checked

    def __attrs_post_init__(self) -> None:
        for f in self.failures:
            if not isinstance(f, Failure) or not 1 <= f.replica <= self.replicas:
                raise InvalidArgumentError(f"failures name replicas 1..{self.replicas}, got {f!r}")

    @property
    def buckets(self) -> list[int]:
        whole, rest = divmod(self.nbytes, self.bucket_bytes)
        return [self.bucket_bytes] * whole + ([rest] if rest else [])


@attrs.frozen
class Outcome:
    all_serve_s: float  # until every replica still alive holds the whole version
    serve_s: tuple[float | None, ...]  # per replica; None: it died
    max_hops: int  # the longest chain of sources, origin = 0
    restarts: int  # copies dropped because a source died


@attrs.define
class _Node:
    index: int
    name: str
    hops: int = 0
    has: int = 0  # buckets held, from the first
    source: int | None = None
    state: str = "asking"  # asking, blocked, waiting, moving, verifying, detecting, done, dead
    epoch: int = 0  # bumps when a scheduled wake-up no longer applies
    readers: set[int] = attrs.Factory(set)  # live leases at this node
    done_at: float | None = None
    offered: bool = False
    exclude: set[str] = attrs.Factory(set)


class _Sim:
    def __init__(self, s: Scenario) -> None:
        self.s = s
        self.sizes = s.buckets
        self.n = len(self.sizes)
        self.nodes = [_Node(0, ORIGIN)] + [_Node(i, f"r{i:05d}") for i in range(1, s.replicas + 1)]
        self.events: list[tuple[float, int, str, int, int]] = []
        self.seq = itertools.count()
        self.now = 0.0
        # Processor sharing per source: virtual time, its last update, the flows moving. One
        # more "source", CHECK, holds the readers checking their copies (core-seconds each).
        self.check = len(self.nodes)
        pools = len(self.nodes) + 1
        self.vt = [0.0] * pools
        self.vt_at = [0.0] * pools
        self.flows: list[dict[int, float]] = [{} for _ in range(pools)]  # reader -> virtual finish
        self.finishes: list[list[tuple[float, int]]] = [[] for _ in range(pools)]  # heaps of the same, lazily kept
        self.stamp = [0] * pools
        self.speed = 1.0  # the share of its demand the cores give every flow and check (cpus)
        self.asking: deque[int] = deque()  # readers that exclude no source, in turn
        self.excluding: list[int] = []  # readers whose source died: they exclude some
        self.ask = False  # whether a source offered itself or gained room since the last asking
        self.offers: list[tuple[tuple[bool, int, int, str], int, int]] = []  # rank, node, its leases then
        self.restarts = 0
        self.dead: set[int] = set()

    # -- scheduling ----------------------------------------------------------------------

    def push(self, at: float, kind: str, node: int, stamp: int) -> None:
        heapq.heappush(self.events, (at, next(self.seq), kind, node, stamp))

    def _rate(self, s: int) -> float:
        """How fast each flow of `s` moves now: bytes/s (core-seconds/s for the checks)."""
        if s == self.check:
            return self.speed
        return self.s.bandwidth * self.speed / len(self.flows[s])

    def _advance(self, s: int) -> None:
        if self.flows[s]:
            self.vt[s] += (self.now - self.vt_at[s]) * self._rate(s)
        self.vt_at[s] = self.now

    def _share_cpus(self) -> None:
        """After flows or checks began or ended: with `cpus`, the cores' share of the demand
        (core-seconds per second) every flow and check gets; all advance at the old share
        first. Without `cpus` the share stays 1."""
        if self.s.cpus is None:
            return
        per_link = self.s.bandwidth * (self.s.send_cpu + self.s.recv_cpu)  # a busy source's link
        demand = per_link * sum(1 for f in self.flows[: self.check] if f) + len(self.flows[self.check])
        speed = min(1.0, self.s.cpus / demand) if demand > 0 else 1.0
        if speed == self.speed:
            return
        busy = [s for s, f in enumerate(self.flows) if f]
        for s in busy:
            self._advance(s)
        self.speed = speed
        for s in busy:
            self._reschedule(s)

    def _reschedule(self, s: int) -> None:
        self.stamp[s] += 1
        flows, heap = self.flows[s], self.finishes[s]
        while heap and flows.get(heap[0][1]) != heap[0][0]:  # ended or stopped since
            heapq.heappop(heap)
        if flows:
            first = heap[0][0]
            at = self.now + max(0.0, first - self.vt[s]) / self._rate(s)
            self.push(at, "moved", s, self.stamp[s])

    # -- sources -------------------------------------------------------------------------

    def _source(self, node: _Node) -> Source:
        cap = self.s.cap
        return Source(node.name, f"host-{node.index}", len(node.readers), cap, node.index not in self.dead, node.hops)

    def _offer(self, node: _Node) -> None:
        node.offered = True
        self._reoffer(node)

    def _reoffer(self, node: _Node) -> None:
        if node.offered and node.index not in self.dead:
            src = self._source(node)
            if not src.full:
                heapq.heappush(self.offers, (rank(src, Reader("any", "elsewhere")), node.index, len(node.readers)))

    def _valid(self, entry: tuple[tuple[bool, int, int, str], int, int]) -> bool:
        node = self.nodes[entry[1]]
        return node.index not in self.dead and node.offered and entry[2] == len(node.readers)

    def _top(self) -> Source | None:
        """The offered source the policy ranks first for a remote reader (stale heap
        entries dropped), or None."""
        while self.offers:
            if self._valid(self.offers[0]):
                return self._source(self.nodes[self.offers[0][1]])
            heapq.heappop(self.offers)
        return None

    def _assign(self, node: _Node, chosen: Source) -> None:
        src = self.nodes[0 if chosen.name == ORIGIN else int(chosen.name[1:])]
        src.readers.add(node.index)
        self._reoffer(src)
        node.source, node.hops = src.index, src.hops + 1
        self._request(node)

    def _ask_all(self) -> None:
        # Readers that exclude none all rank the sources alike (each its own host, none
        # the same as a source's): the policy's pick among every offered source is the
        # heap's top, so it is handed that one; once none is left, the rest wait.
        while self.asking:
            node = self.nodes[self.asking[0]]
            if node.state != "asking":
                self.asking.popleft()
                continue
            top = self._top()
            try:
                chosen = choose_source([top] if top else [], Reader(node.name, f"host-{node.index}"))
            except NoSourceError:
                break
            self.asking.popleft()
            self._assign(node, chosen)
        still = []
        for r in self.excluding:  # after a failure: the policy over every offered source
            node = self.nodes[r]
            offered = {e[1] for e in self.offers if self._valid(e)}
            sources = [self._source(self.nodes[i]) for i in sorted(offered) if i != r]
            try:
                chosen = choose_source(sources, Reader(node.name, f"host-{r}"), exclude=node.exclude)
            except NoSourceError:
                still.append(r)
                continue
            self._assign(node, chosen)
        self.excluding = still

    # -- a reader's steps ----------------------------------------------------------------

    def _request(self, node: _Node) -> None:
        assert node.source is not None
        if node.has >= self.n:
            if self.s.verify_cpu > 0:
                self._start(node, self.check, self.s.nbytes * self.s.verify_cpu, "verifying")
            else:
                self._finish(node)
            return
        if self.nodes[node.source].has > node.has:
            node.state = "waiting"
            node.epoch += 1
            self.push(self.now + self.s.latency + self.s.bucket_overhead, "wake", node.index, node.epoch)
        else:
            node.state = "blocked"

    def _move(self, node: _Node) -> None:
        assert node.source is not None
        self._start(node, node.source, self.sizes[node.has], "moving")

    def _start(self, node: _Node, s: int, work: float, state: str) -> None:
        """A flow of `work` (bytes from source `s`, or core-seconds of checking)."""
        self._advance(s)
        node.state = state
        finish = self.vt[s] + work
        self.flows[s][node.index] = finish
        heapq.heappush(self.finishes[s], (finish, node.index))
        self._reschedule(s)
        self._share_cpus()

    def _landed(self, node: _Node) -> None:
        node.has += 1
        if self.s.relays and not node.offered and (self.s.forward or node.has == self.n):
            self._offer(node)
            self.ask = True
        for c in list(node.readers):
            child = self.nodes[c]
            if child.state == "blocked" and node.has > child.has:
                self._request(child)
        self._request(node)

    def _finish(self, node: _Node) -> None:
        node.state, node.done_at = "done", self.now
        assert node.source is not None
        src = self.nodes[node.source]
        src.readers.discard(node.index)
        self._reoffer(src)
        self.ask = True

    def _descendants(self, r: int) -> set[int]:
        out, todo = set(), [r]
        while todo:
            for c in self.nodes[todo.pop()].readers:
                if c not in out:
                    out.add(c)
                    todo.append(c)
        return out

    def _die(self, r: int) -> None:
        node = self.nodes[r]
        if node.state == "dead":
            return
        self.dead.add(r)
        was = node.state
        node.state, node.epoch = "dead", node.epoch + 1
        if was in ("moving", "verifying"):
            s = self.check if was == "verifying" else node.source
            assert s is not None
            self._advance(s)
            del self.flows[s][r]
            self._reschedule(s)
        if node.source is not None:
            self.nodes[node.source].readers.discard(r)
            self._reoffer(self.nodes[node.source])
        self._advance(r)  # its readers' flows stop
        for c in list(node.readers):
            child = self.nodes[c]
            if child.state == "verifying":  # it holds the whole copy: it needs its source no more
                continue
            self.flows[r].pop(c, None)
            child.state, child.epoch = "detecting", child.epoch + 1
            self.push(self.now + self.s.detect_s, "wake", c, child.epoch)
        node.readers.clear()
        self._reschedule(r)
        self._share_cpus()
        self.ask = True

    def _restart(self, node: _Node) -> None:
        """Its source died: drop the whole copy and ask again."""
        self.restarts += 1
        node.has, node.source, node.state, node.offered = 0, None, "asking", False  # re-offered at its first bucket
        node.exclude = {self.nodes[i].name for i in self.dead | self._descendants(node.index)}
        self.excluding.append(node.index)
        self.ask = True

    # -- the run -------------------------------------------------------------------------

    def run(self) -> Outcome:
        origin = self.nodes[0]
        if self.s.publish_s > 0:
            for j in range(self.n):
                self.push(self.s.publish_s * (j + 1) / self.n, "commit", 0, 0)
        else:
            origin.has = self.n
        self._offer(origin)
        for f in self.s.failures:
            self.push(f.at, "fail", f.replica, 0)
        self.asking = deque(range(1, len(self.nodes)))
        self.ask = True
        while True:
            if self.ask:
                self.ask = False
                self._ask_all()
            if not self.events:
                break
            at, _, kind, i, stamp = heapq.heappop(self.events)
            self.now = max(self.now, at)
            node = self.nodes[min(i, len(self.nodes) - 1)]  # i == self.check only for "moved"
            if kind == "commit":
                origin.has += 1
                self._landed_origin()
            elif kind == "fail":
                self._die(i)
            elif kind == "wake":
                if stamp != node.epoch or i in self.dead:
                    continue
                if node.state == "detecting":
                    self._restart(node)
                elif node.state == "waiting":
                    self._move(node)
            elif kind == "moved":
                if stamp != self.stamp[i]:
                    continue
                self._advance(i)
                flows, heap = self.flows[i], self.finishes[i]
                ended = []
                while heap and heap[0][0] <= self.vt[i] + _EPS * max(1.0, self.vt[i]):
                    finish, r = heapq.heappop(heap)
                    if flows.get(r) == finish:
                        del flows[r]
                        ended.append(r)
                self._reschedule(i)
                self._share_cpus()
                for r in ended:
                    if i == self.check:  # checked: it serves
                        self._finish(self.nodes[r])
                    else:
                        self._landed(self.nodes[r])
        live = [nd for nd in self.nodes[1:] if nd.index not in self.dead]
        if any(nd.done_at is None for nd in live):
            raise RuntimeError("simulate: a live replica never finished (a defect in the model)")
        return Outcome(
            all_serve_s=max((nd.done_at or 0.0 for nd in live), default=0.0),
            serve_s=tuple(None if nd.index in self.dead else nd.done_at for nd in self.nodes[1:]),
            max_hops=max(nd.hops for nd in self.nodes),
            restarts=self.restarts,
        )

    def _landed_origin(self) -> None:
        origin = self.nodes[0]
        for c in list(origin.readers):
            child = self.nodes[c]
            if child.state == "blocked" and origin.has > child.has:
                self._request(child)


def simulate(scenario: Scenario) -> Outcome:
    """Run `scenario` to its end: every replica that did not die holds the version."""
    if not isinstance(scenario, Scenario):
        raise InvalidArgumentError(f"simulate takes a Scenario, got {scenario!r}")
    return _Sim(scenario).run()


def one_read_s(scenario: Scenario) -> float:
    """One replica reading alone from a published slot, then checking its copy: the figure
    a run is calibrated on."""
    s = scenario
    demand = s.bandwidth * (s.send_cpu + s.recv_cpu)
    speed = min(1.0, s.cpus / demand) if s.cpus is not None and demand > 0 else 1.0
    moving = sum(s.latency + s.bucket_overhead + b / (s.bandwidth * speed) for b in s.buckets)
    return moving + s.nbytes * s.verify_cpu

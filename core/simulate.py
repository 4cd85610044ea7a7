"""A discrete-event model of fan-out: how long until N replicas serve a published version.

What it models, per emulated host (one replica per host; a model split across H hosts is
H such slices moving side by side, each its own fan-out, so one slice is simulated):

- **Links.** Every host sends and receives at most `bandwidth` bytes/s. Each end of a
  link is shared equally by the flows there at that moment (processor sharing), and a
  flow moves at the smaller of its two shares. With one reader per host, its own link
  never binds before its source's does when all links are alike.
- **Slices.** With `parts` P, each host holds P slices of `nbytes / P` bytes, each of a
  layout of its own (a tensor-parallel replica's ranks): P readers that share the host's
  link both ways. A reader of layout p reads from the origin (which serves every
  layout, at most `origin_cap` readers at once) or from a reader of layout p elsewhere.
- **Reads.** A reader reads its buckets in order. Each bucket costs `latency` (the read's
  round trip) plus `bucket_overhead` (posting it, completing it, checking it) during
  which the reader moves no bytes, then its bytes at the reader's share.
- **Publish.** The origin's buckets commit evenly over `publish_s` (a streamed
  publish); 0: all are there when the readers start.
- **Relays.** With `relays`, a replica (a slice's reader) offers itself as a source of
  the version once it holds its first bucket (`forward`: buckets are forwarded as they
  arrive, so chains and trees pipeline) or once it holds all of them (not `forward`, as
  slices are relayed); a reader of a relay reads bucket j only after the relay holds it.
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
- **Applying.** `apply_s`: the seconds each reader spends, once it holds its whole copy
  and before it serves, beside its check (a delta's patch and the check of the whole
  version after it, at its host's rates): taken as the check is (with `cpus`,
  core-seconds on one core; without, its own host's time). A copy not forwarded is then
  offered only once applied (`Puller._patched` offers a patched copy once checked).
- **Failures.** A replica that dies (all its slices) stops reading and serving. Each of its readers
  notices after `detect_s` (at most one lease TTL), drops its whole copy (it never keeps
  bytes of two sources) and asks again, never for the dead one or a replica reading
  from it (directly or not), which would wait on it in a cycle.

Pure: no clock, no I/O; `simulate(scenario)` returns the same `Outcome` every time.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence
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


def _default_origin_cap(scenario: Scenario) -> int | None:
    return scenario.cap


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
    # seconds a reader spends on its whole copy before it serves, beside its check (a delta's patch and check)
    apply_s: float = attrs.field(default=0.0, validator=_non_negative("apply_s"))
    # slices per host, each of a layout of its own (a tensor-parallel rank's), each its own reader
    parts: int = attrs.field(default=1, validator=_count("parts"))
    # live leases at the trainer's slot, readers of every layout together; by default `cap`
    origin_cap: int | None = attrs.field(
        default=attrs.Factory(_default_origin_cap, takes_self=True), validator=_check_cap
    )

    def __attrs_post_init__(self) -> None:
        for f in self.failures:
            if not isinstance(f, Failure) or not 1 <= f.replica <= self.replicas:
                raise InvalidArgumentError(f"failures name replicas 1..{self.replicas}, got {f!r}")

    @property
    def slice_bytes(self) -> int:
        """What each of a host's readers receives: `nbytes` over `parts`."""
        return -(-self.nbytes // self.parts)

    @property
    def buckets(self) -> list[int]:
        """Each reader's buckets (of its slice)."""
        whole, rest = divmod(self.slice_bytes, self.bucket_bytes)
        return [self.bucket_bytes] * whole + ([rest] if rest else [])


@attrs.frozen
class Outcome:
    all_serve_s: float  # until every replica still alive holds the whole version
    serve_s: tuple[float | None, ...]  # per replica (its last slice's); None: it died
    max_hops: int  # the longest chain of sources, origin = 0
    restarts: int  # copies dropped because a source died


@attrs.define
class _Node:
    """A reader: a replica, or one slice (`part`) of a replica's host; node 0 is the origin."""

    index: int
    name: str
    host: int = 0  # the origin's 0, a replica's its number
    part: int = 0  # its slice's layout
    hops: int = 0
    has: int = 0  # buckets held, from the first
    source: int | None = None
    state: str = "asking"  # asking, blocked, waiting, moving, verifying, detecting, done, dead
    epoch: int = 0  # bumps when a scheduled wake-up no longer applies
    readers: set[int] = attrs.Factory(set)  # live leases at this node
    done_at: float | None = None
    offered: bool = False
    exclude: set[str] = attrs.Factory(set)


_Entry = tuple[tuple[bool, int, int, str], int, int]  # an offer's rank, its node, its leases then


class _Sim:
    """The event loop. Bytes move as flows between hosts: each end of a link splits it
    equally among its flows, and a flow moves at the smaller of its two shares (what one
    end leaves unused is not handed to the other flows, as max-min fairness would). A
    reader alone on its host (`parts` 1) never binds at its end, so every flow from one
    source moves alike. Flows are kept in pools, one per sending host and count of flows
    into the receiving host, whose flows all move at one rate, each keyed by its finish
    in its pool's virtual time: an event costs a few pools, however many readers a
    source has."""

    def __init__(self, s: Scenario) -> None:
        self.s = s
        self.sizes = s.buckets
        self.n = len(self.sizes)
        self.p = s.parts
        self.nodes = [_Node(0, ORIGIN)]
        for host in range(1, s.replicas + 1):
            for part in range(self.p):
                name = f"r{host:05d}" if self.p == 1 else f"r{host:05d}.{part}"
                self.nodes.append(_Node(len(self.nodes), name, host, part))
        self.named = {nd.name: nd.index for nd in self.nodes}
        self.events: list[tuple[float, int, str, int, int]] = []
        self.seq = itertools.count()
        self.now = 0.0
        # Pool host * parts + k - 1 holds the flows from `host` into hosts that receive k
        # flows. One more, CHECK, holds the readers checking their copies (core-seconds each).
        self.check = (s.replicas + 1) * self.p
        pools = self.check + 1
        self.vt = [0.0] * pools  # virtual time: what each flow of the pool moved since its start
        self.vt_at = [0.0] * pools
        self.flows: list[dict[int, float]] = [{} for _ in range(pools)]  # reader -> virtual finish
        self.finishes: list[list[tuple[float, int]]] = [[] for _ in range(pools)]  # heaps of the same, lazily kept
        self.stamp = [0] * pools
        self.sending = [0] * (s.replicas + 1)  # flows leaving each host
        self.inbound: list[set[int]] = [set() for _ in range(s.replicas + 1)]  # readers moving into each host
        self.pool_of: dict[int, int] = {}  # each moving reader's pool
        self.speed = 1.0  # the share of its demand the cores give every flow and check (cpus)
        self.asking: list[deque[int]] = [deque() for _ in range(self.p)]  # readers that exclude none, per layout
        self.excluding: list[int] = []  # readers whose source died: they exclude some
        self.ask = False  # whether a source offered itself or gained room since the last asking
        self.offers: list[list[_Entry]] = [[] for _ in range(self.p)]  # per layout
        self.restarts = 0
        self.dead: set[int] = set()

    # -- scheduling ----------------------------------------------------------------------

    def push(self, at: float, kind: str, node: int, stamp: int) -> None:
        heapq.heappush(self.events, (at, next(self.seq), kind, node, stamp))

    def _share(self, s: int) -> float:
        """Bytes/s each flow of pool `s` moves at full CPU speed."""
        host, k = divmod(s, self.p)
        return self.s.bandwidth / max(self.sending[host], k + 1)

    def _rate(self, s: int) -> float:
        """How fast each flow of pool `s` moves now: bytes/s (core-seconds/s for the checks)."""
        return self.speed if s == self.check else self._share(s) * self.speed

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
        moving = sum(len(f) * self._share(s) for s, f in enumerate(self.flows[: self.check]) if f)
        demand = moving * (self.s.send_cpu + self.s.recv_cpu) + len(self.flows[self.check])
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

    # -- flows ---------------------------------------------------------------------------

    def _host_of_source(self, r: int) -> int:
        source = self.nodes[r].source
        assert source is not None
        return self.nodes[source].host

    def _flow(self, node: _Node, work: float) -> None:
        """Start `node`'s flow of `work` bytes from its source's host."""
        node.state = "moving"
        self._reflow(start=(node, work))

    def _reflow(self, stop: Sequence[_Node] = (), start: tuple[_Node, float] | None = None) -> None:
        """Stop the flows of `stop` (their bytes landed, or a side died) and start `start`'s.
        Every pool whose rate that changes advances first and is rescheduled after: the
        senders', and those of every flow into the readers' hosts, each of which moves to
        the pool of its host's new count with the bytes it has left."""
        changed = [*stop, *([start[0]] if start else [])]
        dsts = {nd.host for nd in changed}
        movers = {r for d in dsts for r in self.inbound[d]}
        hosts = {self._host_of_source(nd.index) for nd in changed} | {self._host_of_source(r) for r in movers}
        pools = [h * self.p + k for h in sorted(hosts) for k in range(self.p)]
        for s in pools:
            self._advance(s)
        left = {r: self._take(r) for r in sorted(movers)}
        for nd in stop:
            self.sending[self._host_of_source(nd.index)] -= 1
            self.inbound[nd.host].discard(nd.index)
            del left[nd.index]
        if start:
            nd, work = start
            self.sending[self._host_of_source(nd.index)] += 1
            self.inbound[nd.host].add(nd.index)
            left[nd.index] = work
        for r, bytes_left in left.items():
            s = self._host_of_source(r) * self.p + len(self.inbound[self.nodes[r].host]) - 1
            self.pool_of[r] = s
            self.flows[s][r] = finish = self.vt[s] + bytes_left
            heapq.heappush(self.finishes[s], (finish, r))
        for s in pools:
            self._reschedule(s)
        self._share_cpus()

    def _take(self, r: int) -> float:
        """Reader `r`'s flow out of its pool: the bytes it has left."""
        s = self.pool_of.pop(r)
        return self.flows[s].pop(r) - self.vt[s]

    def _check(self, node: _Node, work: float | None) -> None:
        """Start `node`'s check of its copy, `work` core-seconds, or stop it (None)."""
        s = self.check
        self._advance(s)
        if work is None:
            del self.flows[s][node.index]
        else:
            node.state = "verifying"
            self.flows[s][node.index] = finish = self.vt[s] + work
            heapq.heappush(self.finishes[s], (finish, node.index))
        self._reschedule(s)
        self._share_cpus()

    # -- sources -------------------------------------------------------------------------

    def _source(self, node: _Node) -> Source:
        cap = self.s.origin_cap if node.index == 0 else self.s.cap
        return Source(node.name, f"host-{node.host}", len(node.readers), cap, node.index not in self.dead, node.hops)

    def _offer(self, node: _Node) -> None:
        node.offered = True
        self._reoffer(node)

    def _reoffer(self, node: _Node) -> None:
        if node.offered and node.index not in self.dead:
            src = self._source(node)
            if not src.full:
                entry = (rank(src, Reader("any", "elsewhere")), node.index, len(node.readers))
                for part in range(self.p) if node.index == 0 else (node.part,):  # the origin serves every layout
                    heapq.heappush(self.offers[part], entry)

    def _valid(self, entry: _Entry) -> bool:
        node = self.nodes[entry[1]]
        return node.index not in self.dead and node.offered and entry[2] == len(node.readers)

    def _top(self, part: int) -> Source | None:
        """The source of layout `part` the policy ranks first for a remote reader (stale
        heap entries dropped), or None."""
        offers = self.offers[part]
        while offers:
            if self._valid(offers[0]):
                return self._source(self.nodes[offers[0][1]])
            heapq.heappop(offers)
        return None

    def _assign(self, node: _Node, chosen: Source) -> None:
        src = self.nodes[self.named[chosen.name]]
        src.readers.add(node.index)
        self._reoffer(src)
        node.source, node.hops = src.index, src.hops + 1
        self._request(node)

    def _ask_all(self) -> None:
        # Readers of a layout that exclude none all rank its sources alike (each its own
        # host, none the same as a source's): the policy's pick among every offered source
        # is the heap's top, so it is handed that one; once none is left, the rest wait.
        for part, asking in enumerate(self.asking):
            while asking:
                node = self.nodes[asking[0]]
                if node.state != "asking":
                    asking.popleft()
                    continue
                top = self._top(part)
                try:
                    chosen = choose_source([top] if top else [], Reader(node.name, f"host-{node.host}"))
                except NoSourceError:
                    break
                asking.popleft()
                self._assign(node, chosen)
        still = []
        for r in self.excluding:  # after a failure: the policy over every offered source of its layout
            node = self.nodes[r]
            offered = {e[1] for e in self.offers[node.part] if self._valid(e)}
            sources = [self._source(self.nodes[i]) for i in sorted(offered) if i != r]
            try:
                chosen = choose_source(sources, Reader(node.name, f"host-{node.host}"), exclude=node.exclude)
            except NoSourceError:
                still.append(r)
                continue
            self._assign(node, chosen)
        self.excluding = still

    # -- a reader's steps ----------------------------------------------------------------

    def _request(self, node: _Node) -> None:
        assert node.source is not None
        if node.has >= self.n:
            work = self.s.slice_bytes * self.s.verify_cpu + self.s.apply_s
            if work > 0:
                self._check(node, work)
            else:
                self._finish(node)
            return
        if self.nodes[node.source].has > node.has:
            node.state = "waiting"
            node.epoch += 1
            self.push(self.now + self.s.latency + self.s.bucket_overhead, "wake", node.index, node.epoch)
        else:
            node.state = "blocked"

    def _landed(self, node: _Node) -> None:
        node.has += 1
        whole = node.has == self.n and not self.s.apply_s  # an applied copy is offered once applied (`_finish`)
        if self.s.relays and not node.offered and (self.s.forward or whole):
            self._offer(node)
            self.ask = True
        for c in list(node.readers):
            child = self.nodes[c]
            if child.state == "blocked" and node.has > child.has:
                self._request(child)
        self._request(node)

    def _finish(self, node: _Node) -> None:
        node.state, node.done_at = "done", self.now
        if self.s.relays and not node.offered:  # not forwarded, and applied (`apply_s`): whole now
            self._offer(node)
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

    def _die(self, node: _Node) -> None:
        if node.state == "dead":
            return
        self.dead.add(node.index)
        was = node.state
        if was == "moving":
            self._reflow(stop=[node])
        elif was == "verifying":
            self._check(node, None)
        node.state, node.epoch = "dead", node.epoch + 1
        if node.source is not None:
            self.nodes[node.source].readers.discard(node.index)
            self._reoffer(self.nodes[node.source])
        for c in list(node.readers):  # its readers' flows stop
            child = self.nodes[c]
            if child.state == "verifying":  # it holds the whole copy: it needs its source no more
                continue
            if child.state == "moving":
                self._reflow(stop=[child])
            child.state, child.epoch = "detecting", child.epoch + 1
            self.push(self.now + self.s.detect_s, "wake", c, child.epoch)
        node.readers.clear()
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
        for nd in self.nodes[1:]:
            self.asking[nd.part].append(nd.index)
        self.ask = True
        while True:
            if self.ask:
                self.ask = False
                self._ask_all()
            if not self.events:
                break
            at, _, kind, i, stamp = heapq.heappop(self.events)
            self.now = max(self.now, at)
            if kind == "commit":
                origin.has += 1
                self._landed_origin()
            elif kind == "fail":  # every slice of the replica's host
                for nd in self.nodes[1 + (i - 1) * self.p : 1 + i * self.p]:
                    self._die(nd)
            elif kind == "wake":
                node = self.nodes[i]
                if stamp != node.epoch or i in self.dead:
                    continue
                if node.state == "detecting":
                    self._restart(node)
                elif node.state == "waiting":
                    self._flow(node, self.sizes[node.has])
            elif kind == "moved" and stamp == self.stamp[i]:
                self._moved(i)
        return self._outcome()

    def _moved(self, s: int) -> None:
        """Pool `s`'s first flows may have ended: each that did lands its bucket (or, a
        check, lets its reader serve)."""
        self._advance(s)
        flows, heap = self.flows[s], self.finishes[s]
        due: dict[int, float] = {}  # a flow moved back into its pool with its finish unchanged is on the heap twice
        while heap and heap[0][0] <= self.vt[s] + _EPS * max(1.0, self.vt[s]):
            finish, r = heapq.heappop(heap)
            if flows.get(r) == finish:
                due[r] = finish
        if not due:
            self._reschedule(s)
            return
        for r, finish in due.items():  # back on the heap: each is taken out as any stopped flow is
            heapq.heappush(heap, (finish, r))
        ended = list(due)
        if s == self.check:
            for r in ended:
                self._check(self.nodes[r], None)
        else:
            self._reflow(stop=[self.nodes[r] for r in ended])
        for r in ended:
            if s == self.check:  # checked: it serves
                self._finish(self.nodes[r])
            else:
                self._landed(self.nodes[r])

    def _outcome(self) -> Outcome:
        live = [nd for nd in self.nodes[1:] if nd.index not in self.dead]
        if any(nd.done_at is None for nd in live):
            raise RuntimeError("simulate: a live replica never finished (a defect in the model)")
        serve: list[float | None] = []
        for host in range(1, self.s.replicas + 1):
            mine = self.nodes[1 + (host - 1) * self.p : 1 + host * self.p]
            serve.append(None if any(nd.index in self.dead for nd in mine) else max(nd.done_at or 0.0 for nd in mine))
        return Outcome(
            all_serve_s=max((t for t in serve if t is not None), default=0.0),
            serve_s=tuple(serve),
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
    """One replica reading alone from a published slot, then checking its copy (and
    applying it, `apply_s`): the figure a run is calibrated on. With `parts`, its slices
    move at once, each at its share of the host's link, then are checked at once, each on
    a core."""
    s = scenario
    demand = s.bandwidth * (s.send_cpu + s.recv_cpu)
    speed = min(1.0, s.cpus / demand) if s.cpus is not None and demand > 0 else 1.0
    moving = sum(s.latency + s.bucket_overhead + b * s.parts / (s.bandwidth * speed) for b in s.buckets)
    checking = min(1.0, s.cpus / s.parts) if s.cpus is not None else 1.0
    return moving + (s.slice_bytes * s.verify_cpu + s.apply_s) / checking

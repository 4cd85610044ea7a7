"""The served registry's Prometheus endpoint (`RegistryServer(metrics_port=...)`).

Nothing is counted as it happens: at each scrape the collector asks the server's event
loop for the registry's status, so the figures are one consistent snapshot, taken
where the registry lives (the HTTP server answers from a thread of its own). Needs
`prometheus-client`, in the `service` extra; imported only when a port is asked for.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import anyio.from_thread
import anyio.lowlevel
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from weightpull.errors import RegistryError
from weightpull.states import VersionState

if TYPE_CHECKING:
    from .server import RegistryServer


class StatusCollector:
    """Reads the status of `server`'s registry at scrape time, on `server`'s event loop."""

    def __init__(self, server: RegistryServer, token: anyio.lowlevel.EventLoopToken) -> None:
        self.server, self.token = server, token

    def collect(self) -> Iterator[Metric]:
        s = anyio.from_thread.run(self.server.registry.status, token=self.token)
        states = Counter(v.state for v in s.versions)
        count = GaugeMetricFamily(
            "weightpull_registry_versions", "Versions the registry holds, by state", labels=["state"]
        )
        for state in VersionState:
            if state is not VersionState.RECLAIMED:  # reclaimed records are dropped
                count.add_metric([state.value], states[state])
        yield count
        if s.newest_ready is not None:
            yield GaugeMetricFamily(
                "weightpull_registry_newest_ready_version", "The newest READY version", value=s.newest_ready
            )

        state = GaugeMetricFamily(
            "weightpull_registry_version_state",
            "1 for each version, labelled with its state and publisher",
            labels=["version", "state", "publisher"],
        )
        leases = GaugeMetricFamily(
            "weightpull_registry_version_live_leases", "Live leases on each version", labels=["version"]
        )
        nbytes = GaugeMetricFamily(
            "weightpull_registry_version_bytes", "Bytes of each announced version", labels=["version"]
        )
        age = GaugeMetricFamily(
            "weightpull_registry_version_age_seconds", "Seconds since each version began", labels=["version"]
        )
        for v in s.versions:
            label = str(v.version)
            state.add_metric([label, v.state.value, v.publisher], 1)
            leases.add_metric([label], v.live_leases)
            age.add_metric([label], v.age)
            if v.nbytes is not None:
                nbytes.add_metric([label], v.nbytes)
        yield from (state, leases, nbytes, age)

        yield GaugeMetricFamily("weightpull_registry_live_leases", "Live leases on every version", value=len(s.leases))
        holders = GaugeMetricFamily(
            "weightpull_registry_leases_by_holder", "Live leases each reader holds", labels=["holder"]
        )
        for holder, n in sorted(Counter(x.holder for x in s.leases).items()):
            holders.add_metric([holder], n)
        yield holders

        serving = GaugeMetricFamily(
            "weightpull_replica_serving_version", "The version each replica reported serving", labels=["replica"]
        )
        behind = GaugeMetricFamily(
            "weightpull_replica_versions_behind",
            "The newest READY version less the one each replica serves",
            labels=["replica"],
        )
        for replica, version in sorted(s.serving.items()):
            serving.add_metric([replica], version)
            if s.newest_ready is not None:
                behind.add_metric([replica], s.newest_ready - version)
        yield from (serving, behind)
        alive = GaugeMetricFamily(
            "weightpull_registry_principal_alive_seconds",
            "Seconds each principal's liveness has left (<= 0: lapsed, its versions withdrawn)",
            labels=["principal"],
        )
        for name, left in sorted(s.alive.items()):
            alive.add_metric([name], left)
        yield alive

        yield CounterMetricFamily("weightpull_registry_requests", "Requests answered", value=self.server.served)
        yield CounterMetricFamily(
            "weightpull_registry_refused",
            "Messages and handshakes refused (keys, framing, MAC, replay...)",
            value=self.server.refused,
        )


class MetricsEndpoint:
    """`/metrics` over HTTP on `host:port` (port 0 picks one) until `close()`."""

    def __init__(self, server: RegistryServer, host: str, port: int) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatusCollector(server, anyio.lowlevel.current_token()))
        self._httpd: Any
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise RegistryError(f"cannot serve metrics on {host}:{port}: {exc}") from None
        self.host, self.port = host, self._httpd.server_port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Blocks until the HTTP thread stops: call it off the event loop, which a scrape
        in progress may still be waiting on."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

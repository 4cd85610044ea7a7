"""Emulated hosts (weightpull.integrations.bench.hosts) and the fan-out across them.

They need root (CI runs as root); each test checks that every namespace it made is gone
afterwards, also when the test body failed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from weightpull.errors import InvalidArgumentError
from weightpull.integrations.bench import hosts as hostsmod
from weightpull.integrations.bench.hosts import Hosts, namespaces

pytestmark = pytest.mark.skipif(hostsmod.unavailable_reason() is not None, reason=str(hostsmod.unavailable_reason()))


@pytest.fixture(autouse=True)
def nothing_left_behind(monkeypatch):
    """Every namespace of the hosts this test made (in this process) is gone afterwards.
    Only its own: under `make test` another file's hosts (tests/test_fanout_forms.py, on
    the other worker) come and go meanwhile."""
    made = []
    init = Hosts.__init__

    def tracking(self, *args, **kwargs):
        made.append(self)  # before it makes any, so that hosts failing half way are counted too
        init(self, *args, **kwargs)

    monkeypatch.setattr(Hosts, "__init__", tracking)
    yield
    tags = [f"{hostsmod.PREFIX}{h.tag}" for h in made if hasattr(h, "tag")]
    left = [ns for ns in namespaces() if ns.startswith(tuple(tags))] if tags else []
    assert not left, f"a test left namespaces behind: {left}"


def _send(h: Hosts, sender: int, receiver: int, nbytes: int, *, control: bool = False) -> float:
    """Seconds for `nbytes` over TCP from host `sender` to host `receiver` (at its data
    address, or its control one), as the receiver saw them."""
    server = subprocess.Popen(
        h.command(
            receiver,
            [
                sys.executable,
                "-c",
                "import socket,time\n"
                "s=socket.socket();s.bind(('0.0.0.0',5001));s.listen();print('up',flush=True)\n"
                "c,_=s.accept();n=0;t=None\n"
                "while (b:=c.recv(1<<20)):\n"
                "    t=t or time.perf_counter();n+=len(b)\n"
                "print(n,time.perf_counter()-t)",
            ],
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None and server.stdout.readline().strip() == "up"
    to = h.control_address(receiver) if control else h.address(receiver)
    code = f"import socket;s=socket.create_connection(('{to}',5001));s.sendall(bytes({nbytes}));s.close()"
    subprocess.run(h.command(sender, [sys.executable, "-c", code]), check=True, timeout=60)
    got, seconds = server.communicate(timeout=60)[0].split()
    assert int(got) == nbytes
    return float(seconds)


def test_hosts_reach_each_other_only_through_their_shaped_links():
    with Hosts(2, rate="80mbit") as h:
        assert set(namespaces()) >= {h.switch, h.name(0), h.name(1)}
        # the machine's own namespace holds none of their links
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert f"wf{h.tag}" not in links
        seconds = _send(h, 1, 0, 4 << 20)
        # 80 Mbit/s is 10 MB/s: 4 MiB cannot land in much under 0.3 s (the burst lets ~1 MB through early)
        assert seconds > 0.25, f"4 MiB in {seconds:.3f} s: the link is not shaped"
    assert not {h.switch, h.name(0), h.name(1)} & set(namespaces())


def test_a_control_network_beside_the_shaped_links_is_not_shaped():
    with Hosts(2, rate="80mbit", control=True) as h:
        assert _send(h, 1, 0, 4 << 20) > 0.25  # the data link, shaped as before
        # the control link: 4 MiB in well under the 0.4 s 80 Mbit/s would take
        assert _send(h, 1, 0, 4 << 20, control=True) < 0.15
        # every host reaches the switch's own address on it (where the fan-out bench serves its registry)
        listen = f"import socket;s=socket.socket();s.bind(('{h.hub_address}',5002));s.listen();print('up',flush=True)"
        hub = subprocess.Popen(
            h.hub_command([sys.executable, "-c", listen + ";c,_=s.accept();print(c.recv(2).decode())"]),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert hub.stdout is not None and hub.stdout.readline().strip() == "up"
        hello = f"import socket;socket.create_connection(('{h.hub_address}',5002)).sendall(b'hi')"
        subprocess.run(h.command(1, [sys.executable, "-c", hello]), check=True, timeout=30)
        assert hub.communicate(timeout=30)[0].strip() == "hi"
        assert f"wf{h.tag}" not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def test_a_failure_inside_still_deletes_every_namespace():
    with pytest.raises(RuntimeError, match="boom"):
        with Hosts(3) as h:
            made = list(h.made)
            raise RuntimeError("boom")
    assert not set(made) & set(namespaces())


def test_a_failure_while_making_them_deletes_what_was_made():
    with pytest.raises(RuntimeError, match="tbf"):
        Hosts(2, rate="not-a-rate")


@pytest.mark.parametrize("count", [0, hostsmod.MAX_HOSTS + 1, True, "2"])
def test_a_bounded_count(count):
    with pytest.raises(InvalidArgumentError, match="hosts must be"):
        Hosts(count)


def test_fanout_across_hosts_is_byte_exact_and_crosses_the_trainers_link():
    from weightpull.integrations.bench.fanout import run_fanout

    result = run_fanout([1, 2], size=8 << 20, bucket=2 << 20, rate="100mbit")
    rows = {r["replicas"]: r for r in result["rows"]}
    assert all(r["byte_exact"] for r in rows.values())
    assert rows[2]["sources"] == ["trainer", "trainer"] and rows[2]["hops"] == 1  # plain pullers: the slot
    # Two copies of 8 MiB leave the trainer through 100 Mbit/s (12.5 MB/s): not in under
    # ~1.3 s, unless UCX bypassed the links (shared memory, CMA) instead of using TCP.
    floor = 2 * (8 << 20) / 12.5e6
    assert rows[2]["all_serve_s"] > 0.8 * floor, rows
    # every process says the CPU it spent, the registry's is read, and the machine's over the run
    for r in rows.values():
        assert r["trainer_cpu_s"] > 0 and len(r["replica_cpu_s"]) == r["replicas"], r
        assert all(c > 0 for c in r["replica_cpu_s"]) and r["busy_cpu_s"] > 0 and r["registry_cpu_s"] >= 0, r
        mine = r["trainer_cpu_s"] + sum(r["replica_cpu_s"]) + r["registry_cpu_s"]
        assert r["procs_cpu_s"] == pytest.approx(mine, abs=0.01)
        assert r["busy_cpu_s"] <= r["cpus"] * r["wall_s"] * 1.05 + 0.05, r  # no more than the cores had
    # the publisher records digests in both modes alike, and a plain puller checks them too
    assert result["cpus"] == os.cpu_count() and result["digest"] == "wsum64" and rows[1]["verify_cpu_s"] > 0


@pytest.mark.parametrize("digest", ["wsum64", "blake2b128"])
def test_fanout_through_a_relay_is_byte_exact_and_checked_against_the_publishers_digests(digest):
    from weightpull.integrations.bench.fanout import run_fanout

    result = run_fanout([1, 2], size=8 << 20, bucket=2 << 20, rate="200mbit", relays=True, cap=1, digest=digest)
    one, row = result["rows"]
    # the registry lets one reader at a time read the trainer's slot: the other was refused
    # (asking again) until the first offered what it held, then placed there, a relay
    assert row["hops"] == 2 and row["byte_exact"], row
    relay = row["sources"].index("trainer")
    reader = 1 - relay
    assert row["sources"][reader] == f"replica{relay + 1}" and row["replica_hops"][reader] == 2, row
    assert row["refused"][reader] > 0 and row["refused"][relay] == 0, row
    assert result["digest"] == digest and one["verify_cpu_s"] > 0, one  # the one reader's check, measured
    # the relay is offered once it holds a bucket; its reader holds one after it was placed there
    first, handed = row["first_bucket_s"], row["handed_s"]
    assert first[relay] <= handed[reader] and first[reader] > handed[reader], row


def test_tensor_parallel_replicas_pull_their_slices_across_hosts_each_checked_against_the_oracle():
    """Two ranks a replica, each a process in the replica's host pulling its slice of a
    Qwen3-shaped model, relaying: a rank reads the trainer's slot or the same rank of
    another replica, never another layout's, and every slice equals the oracle's (numpy on
    the model's tensors) and its peers' at the same rank. (The bench's direct ranks differ
    only in reading the slot alone; one run keeps this test's processes few.)"""
    from weightpull.integrations.bench.fanout import run_fanout

    result = run_fanout([1, 2], size=8 << 20, bucket=1 << 20, rate="100mbit", tp=2, relays=True, cap=1)
    one, row = result["rows"]
    assert result["tp"] == 2 and result["origin_cap"] == 2 and result["size_bytes"] == result["model_bytes"]
    assert one["byte_exact"] and row["byte_exact"] and not row["mismatched"], row
    assert len(row["rank_serve_s"]) == 4 and len(row["replica_cpu_s"]) == 2, row
    holders = [f"replica{i}/rank{r}" for i in (1, 2) for r in (0, 1)]
    for holder, source, hops in zip(holders, row["sources"], row["replica_hops"], strict=True):
        assert source == "trainer" or (source != holder and source.endswith(holder[-6:])), (holder, source)
        assert (hops == 1) == (source == "trainer"), row
    # at least one copy of the model left the trainer through 100 Mbit/s (12.5 MB/s)
    assert row["all_serve_s"] > 0.8 * result["model_bytes"] / 12.5e6, row
    # a relay's slice is checked against its digests: the one replica's ranks measured what that costs
    assert one["verify_cpu_s"] > 0 and row["procs_cpu_s"] > 0


def test_a_sigterm_still_deletes_every_namespace(tmp_path):
    """`timeout` or a cancelled CI job sends SIGTERM: the hosts go all the same."""
    script = tmp_path / "hold.py"
    script.write_text(
        "import time\n"
        "from weightpull.integrations.bench.hosts import Hosts\n"
        "with Hosts(2) as h:\n"
        "    print(' '.join(h.made), flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    made = proc.stdout.readline().split()
    assert len(made) == 3 and set(made) <= set(namespaces())
    proc.terminate()
    assert proc.wait(30) == 128 + 15
    assert not set(made) & set(namespaces())

"""`weightpull doctor`: each check through the command line and the module's functions,
against a served, keyed registry, a dead port, bad keys, a loopback NIXL read between two
processes, and fakes of what this host lacks (a Yama scope, GPUs, a small /dev/shm)."""

import json
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from weightpull.integrations import doctor
from weightpull.integrations.cli import main

from .served import CLEARED, ServedRegistry, env, make_keys

pytest.importorskip("zmq")

LOCAL = ["--skip", "transport", "--skip", "gpus"]  # the checks that cost nothing here


@pytest.fixture(autouse=True)
def _no_client_environment(monkeypatch):
    for name in CLEARED:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    base = tmp_path_factory.mktemp("doctor")
    served = ServedRegistry(base, keys=make_keys(base / "keys", ("reader", "replica-0")))
    served.start()
    served.stranger = make_keys(base / "elsewhere", ("reader", "stranger"))
    yield served
    served.stop()


def doctor_json(capsys, *args):
    status = main(["doctor", *args, "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    return status, {r["name"]: r for r in json.loads(out[-1])}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- keys and the registry -------------------------------------------------------------------


def test_a_known_key_and_a_live_registry_pass_with_the_round_trip_and_clock(keyed, capsys):
    key = keyed.key("replica-0")
    status, got = doctor_json(
        capsys, "--registry", keyed.address, "--key", key["key"], "--server-key", key["server_key"], *LOCAL
    )
    assert status == 0, got
    assert got["keys"]["status"] == "ok" and "reader replica-0" in got["keys"]["found"]
    assert "known to the server" in got["keys"]["found"] and "from --key" in got["keys"]["found"]
    reg = got["registry"]
    assert reg["status"] == "ok" and reg["data"]["run"] == keyed.epoch
    assert 0 < reg["data"]["rtt_ms"] < 1000
    assert abs(reg["data"]["clock_rate"] - 1) < 0.05 and reg["data"]["measured_over_s"] >= 0.9
    assert abs(reg["data"]["clock_offset_s"]) < 1  # one host, one clock
    assert list(got) == ["keys", "registry", "ptrace", "shm"]


def test_the_key_from_the_environment_is_named_as_its_source(keyed, capsys, monkeypatch):
    key = keyed.key("replica-0")
    monkeypatch.setenv("WEIGHTPULL_KEY", key["key"])
    monkeypatch.setenv("WEIGHTPULL_SERVER_KEY", key["server_key"])
    result = doctor.check_keys(doctor.KeyChoice.of())
    assert result.status == "ok" and "from $WEIGHTPULL_KEY" in result.found and "--registry" in result.found


def test_a_key_unknown_to_the_server_fails_with_its_fix(keyed, capsys):
    started = time.monotonic()
    status = main(
        [
            "doctor",
            "--registry",
            keyed.address,
            "--key",
            str(keyed.stranger / "stranger.key_secret"),
            "--server-key",
            str(keyed.keys / "registry.key"),
            *LOCAL,
        ]
    )
    lines = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()}
    assert status == 1 and time.monotonic() - started < 5  # told at the handshake, not timed out
    assert lines["keys"].startswith("FAIL keys") and "unknown to the server" in lines["keys"]
    assert "fix: its operator adds stranger.key to the server's --keys directory" in lines["keys"]
    assert lines["registry"].startswith("warn registry") and "refused this client" in lines["registry"]


def test_no_key_to_a_registry_that_takes_keys_fails(keyed, capsys):
    status, got = doctor_json(capsys, "--registry", keyed.address, *LOCAL)
    assert status == 1 and got["keys"]["status"] == "fail" and "takes keys" in got["keys"]["found"]


def test_no_key_is_a_skip_and_the_deprecated_secret_a_warning(monkeypatch):
    assert doctor.check_keys(doctor.KeyChoice.of()).status == "skip"
    monkeypatch.setenv("WEIGHTPULL_SECRET", "s")
    warned = doctor.check_keys(doctor.KeyChoice.of())
    assert warned.status == "warn" and "deprecated" in warned.found and "keys new" in warned.fix


def test_a_public_key_a_server_key_and_a_missing_file_are_refused_as_keys(keyed, capsys, tmp_path):
    server_key = str(keyed.keys / "registry.key")
    cases = [
        (str(keyed.keys / "replica-0.key"), "is a public key", "pass replica-0.key_secret"),
        (str(keyed.keys / "registry.key_secret"), "the server's own key", "this client's NAME.key_secret"),
        (str(tmp_path / "nope.key_secret"), "cannot read the key file", "`weightpull keys new` wrote"),
    ]
    for key, found, fix in cases:
        status, got = doctor_json(capsys, "--key", key, "--server-key", server_key, *LOCAL)
        assert status == 1, key
        assert got["keys"]["status"] == "fail" and found in got["keys"]["found"] and fix in got["keys"]["fix"]
    status, got = doctor_json(capsys, "--key", str(keyed.keys / "replica-0.key_secret"), *LOCAL)
    assert status == 1 and "no server key" in got["keys"]["found"] and "--server-key" in got["keys"]["fix"]


def test_a_dead_registry_fails_quickly_with_the_fix(capsys):
    started = time.monotonic()
    status = main(["doctor", "--registry", f"tcp://127.0.0.1:{free_port()}", "--timeout", "0.5", *LOCAL])
    line = [x for x in capsys.readouterr().out.splitlines() if " registry " in x][0]
    assert status == 1 and time.monotonic() - started < 4
    assert line.startswith("FAIL registry") and "no answer from" in line
    assert "fix: is `weightpull registry serve` running there?" in line


@pytest.mark.parametrize("address", ["localhost:5555", "tcp://nohost", "http://x:1", "tcp://h:99999"])
def test_a_malformed_registry_address_is_a_usage_error(capsys, address):
    assert main(["doctor", "--registry", address, "--json"]) == 2
    captured = capsys.readouterr()
    assert "is not a registry address: write tcp://HOST:PORT" in captured.err
    assert json.loads(captured.out.splitlines()[-1])["error"]["exit_status"] == 2
    with pytest.raises(doctor.InvalidArgumentError, match="not a registry address"):
        doctor.run_checks(registry=address)


def test_a_ray_registry_is_skipped_with_why():
    result = doctor.check_registry("ray://weights", None)
    assert result.status == "skip" and "inside a Ray job" in result.found and "RayRegistry" in result.fix


# -- transport -------------------------------------------------------------------------------


def test_an_unreachable_peer_fails_with_the_fix(capsys):
    pytest.importorskip("nixl_cu13")
    status, got = doctor_json(capsys, "--peer", f"127.0.0.1:{free_port()}", "--skip", "gpus")
    t = got["transport"]
    assert status == 1 and t["status"] == "fail" and "cannot reach 127.0.0.1" in t["found"]
    assert "weightpull doctor --listen" in t["fix"]


def test_a_malformed_peer_is_a_usage_error(capsys):
    assert main(["doctor", "--peer", "host:port"]) == 2
    assert "is not HOST:PORT" in capsys.readouterr().err
    assert main(["doctor", "--device", "gpu"]) == 2
    assert "'gpu' is not cpu, cuda or cuda:N" in capsys.readouterr().err


def test_the_loopback_read_through_the_command_names_cma_and_its_speed():
    """The whole command once, in a process of its own: every check, the loopback NIXL read
    between two more processes, the JSON list as stdout's last line."""
    pytest.importorskip("nixl_cu13")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "weightpull", "doctor", "--json"],
        env=env(None),
        capture_output=True,
        text=True,
        timeout=60,
    )
    got = {r["name"]: r for r in json.loads(done.stdout.strip().splitlines()[-1])}
    assert done.returncode == 0, got
    assert list(got) == list(doctor.CHECKS) and time.monotonic() - started < 30
    t = got["transport"]
    assert t["status"] in ("ok", "warn") and t["found"].startswith("loopback (two processes of this host)")
    assert t["data"]["intact"] and t["data"]["gbps"] > 0 and t["data"]["nbytes"] == 64 << 20
    kinds = {x["kind"] for x in t["data"]["transports"]}
    if got["ptrace"]["status"] == "ok":
        assert kinds == {"CMA"} and t["status"] == "ok", t
    else:
        assert "TCP" in kinds and t["status"] == "warn"


def test_ucx_protocol_tables_give_the_transports_of_reads():
    log = "\n".join(
        f"[1.0] [vm:1 :0]   {line}"
        for line in (
            "| agent self cfg#0                                     |",
            "| remote memory read by ucp_get* into host memory from host |",
            "| Range  | Description |   Config    |",
            "| 0..inf | zero-copy   | cma/memory  |",
            "| agent inter-node cfg#2                               |",
            "| active message by ucp_am_send* from host memory      |",
            "|   0..8 | short       | tcp/eth0    |",
            "| remote memory read by ucp_get*(multi) into cuda memory from cuda |",
            "| 0..inf | zero-copy   | 50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1 |",
            "| agent intra-node cfg#3                               |",
            "| remote memory read by ucp_get* into cuda memory from cuda |",
            "| 0..inf | zero-copy   | cuda_ipc/cuda |",
        )
    )
    assert doctor.read_transports(log) == [
        {"config": "rc_mlx5/mlx5_0:1", "kind": "RDMA (rc)", "scope": "inter-node"},
        {"config": "rc_mlx5/mlx5_1:1", "kind": "RDMA (rc)", "scope": "inter-node"},
        {"config": "cuda_ipc/cuda", "kind": "CUDA IPC", "scope": "intra-node"},
    ]
    assert [doctor.kind_of(c) for c in ("dc_mlx5/x", "ud_verbs/x", "tcp/lo", "cuda_copy/cuda")] == [
        "RDMA (dc)",
        "RDMA (ud)",
        "TCP",
        "CUDA copy (through host memory)",
    ]


def test_a_same_host_read_over_tcp_warns_about_cma():
    result = {"ok": True, "nbytes": 1 << 20, "gbps": 1.0, "reads": 3, "first_s": 0.1, "intact": True}
    tcp = [{"config": "tcp/lo", "kind": "TCP", "scope": "intra-node"}]
    same = doctor.verdict({**result, "transports": tcp}, loopback=True, peer="127.0.0.1:1")
    assert same.status == "warn" and "CMA is off" in same.fix
    remote = [{"config": "tcp/eth0", "kind": "TCP", "scope": "inter-node"}]
    far = doctor.verdict({**result, "transports": remote}, loopback=False, peer="h:1")
    assert far.status == "warn" and "no RDMA device" in far.fix


def test_nixl_missing_is_a_skip_with_the_extra(monkeypatch):
    from weightpull.errors import DriverUnavailableError

    def missing(name):
        raise DriverUnavailableError("nixl needs the nixl extra")

    monkeypatch.setattr("weightpull.transports.transport_class", missing)
    result = doctor.check_transport()
    assert result.status == "skip" and result.fix == "pip install 'weightpull[nixl]'"


# -- ptrace, /dev/shm, GPUs ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scope", "cap", "status", "says"),
    [
        ("0", False, "ok", "CMA reads between this host's processes"),
        ("1", False, "ok", "PR_SET_PTRACER_ANY"),
        ("2", True, "ok", "CMA works"),
        ("2", False, "warn", "UCX turns CMA off"),
        ("3", True, "warn", "UCX turns CMA off"),
    ],
)
def test_ptrace_scope_and_the_capability_say_whether_cma_works(tmp_path, monkeypatch, scope, cap, status, says):
    (tmp_path / "ptrace_scope").write_text(scope + "\n")
    monkeypatch.setattr(doctor, "_cap_sys_ptrace", lambda: cap)
    result = doctor.check_ptrace(tmp_path / "ptrace_scope")
    assert result.status == status and says in result.found and result.data["ptrace_scope"] == int(scope)
    if scope == "2" and not cap:
        assert "kernel.yama.ptrace_scope=1" in result.fix and "SYS_PTRACE" in result.fix
    if scope == "3":
        assert "reboot" in result.fix


def test_ptrace_here_tries_process_vm_readv(tmp_path, monkeypatch):
    real = doctor.check_ptrace(tmp_path / "absent")
    assert real.data["process_vm_readv"] is True and "no Yama" in real.found  # this host allows it
    monkeypatch.setattr(doctor, "_process_vm_readv_works", lambda: (False, "Operation not permitted"))
    blocked = doctor.check_ptrace(tmp_path / "absent")
    assert blocked.status == "warn" and "seccomp" in blocked.fix


def test_shm_against_a_model_size(capsys, monkeypatch):
    status, got = doctor_json(capsys, "--model-bytes", "1000000T", *LOCAL)
    assert status == 1 and got["shm"]["status"] == "fail" and "--shm-size" in got["shm"]["fix"]
    status, got = doctor_json(capsys, "--model-bytes", "1M", *LOCAL)
    assert status == 0 and got["shm"]["status"] == "ok" and got["shm"]["data"]["model_bytes"] == 1 << 20
    monkeypatch.setattr(doctor.os, "statvfs", lambda path: SimpleNamespace(f_bavail=16, f_frsize=1 << 20, f_blocks=64))
    small = doctor.check_shm()
    assert small.status == "warn" and "16 MiB free of 64 MiB" in small.found
    assert main(["doctor", "--model-bytes", "lots"]) == 2


def fake_torch(count, denied=()):
    cuda = SimpleNamespace(
        is_available=lambda: count > 0,
        device_count=lambda: count,
        can_device_access_peer=lambda i, j: (i, j) not in denied,
    )
    return SimpleNamespace(cuda=cuda)


def test_gpu_peer_access_of_each_pair():
    assert doctor.check_gpus(fake_torch(4)).status == "ok"
    partial = doctor.check_gpus(fake_torch(3, denied={(0, 2), (2, 0)}))
    assert partial.status == "warn" and "2 of 6 pairs (0->2, 2->0)" in partial.found
    assert "nvidia-smi topo -m" in partial.fix and partial.data["no_peer_access"] == [[0, 2], [2, 0]]
    assert doctor.check_gpus(fake_torch(0)).status == "skip"
    here = doctor.check_gpus()
    assert here.status == "skip", here  # no GPU on this host, and told without importing torch for it


def test_a_check_that_hangs_fails_at_its_limit():
    started = time.monotonic()
    result = doctor.bounded("shm", lambda: time.sleep(5) or doctor.check_shm(), 0.2)()
    assert result.status == "fail" and "did not finish within 0.2 s" in result.found
    assert time.monotonic() - started < 1


def test_the_lines_and_help(capsys):
    assert doctor.Result("keys", "ok", "fine").line() == "ok   keys      fine"
    assert doctor.Result("registry", "fail", "gone", "start it").line() == "FAIL registry  gone; fix: start it"
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    assert "--listen" in capsys.readouterr().out
    assert os.environ.get("WEIGHTPULL_KEY") is None

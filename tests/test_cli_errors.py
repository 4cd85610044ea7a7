"""Every command's failure modes, each in a process of its own as a user meets them: one
`error:` line on stderr naming the cause and the fix, exit status 2 for a wrong command line
and 1 for a failure while running, a JSON error object on stdout with --json, and no
traceback anywhere."""

import importlib.metadata
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import anyio
import pytest

import weightpull
from weightpull import list_transports
from weightpull.errors import PeerGoneError

pytest.importorskip("zmq")

from .served import SECRET, env  # noqa: E402
from .served import cli as run  # noqa: E402


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The single line a failed command writes to stderr; fails on anything more."""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    return lines[0]


def free_address() -> str:
    """A loopback address nothing listens on (the port was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


UNAVAILABLE = [d.name for d in list_transports() if not d.available]

# (arguments, exit status, what the error line must say)
FAILURES = [
    (("demo", "--transport", "nope"), 2, "no transport named 'nope'; known: "),
    (("demo", "--size-mib", "-3"), 2, "argument --size-mib: must be at least 1, got -3"),
    (("demo", "--size-mib", "0"), 2, "argument --size-mib: must be at least 1, got 0"),
    (("demo", "--versions", "1"), 2, "argument --versions: must be at least 2, got 1"),
    (("demo", "--replicas", "two"), 2, "argument --replicas: 'two' is not a whole number"),
    (("demo", "--ttl", "0"), 2, "argument --ttl: must be above 0"),
    (("demo", "--engine", "sglang"), 2, "argument --engine: invalid choice"),
    (("bench", "model", "--transport", "nope"), 2, "no transport named 'nope'"),
    (("bench", "pull", "--transport", "nope"), 2, "no transport named 'nope'"),
    (("bench", "model", "--versions", "0"), 2, "argument --versions: must be at least 1, got 0"),
    (("bench", "pull", "--size", "1M", "--repeat", "0"), 2, "argument --repeat: must be at least 1, got 0"),
    (("bench", "pull", "--size", "lots"), 2, "size must be a positive number of bytes like 256M or 1G"),
    (("bench", "pull", "--preset", "tiny"), 2, "unrecognized arguments: --preset tiny"),
    (("bench", "nope"), 2, "argument FIGURE: invalid choice: 'nope'"),
    (("bench", "fsdp", "--publishes", "0"), 2, "argument --publishes: must be at least 1, got 0"),
    (("registry", "serve", "--bind", "tcp://127.0.0.1"), 2, "'tcp://127.0.0.1' needs a host and a port"),
    (
        ("registry", "serve", "--bind", "127.0.0.1:5603"),
        2,
        "'127.0.0.1:5603' has no scheme: write tcp://127.0.0.1:5603",
    ),
    (("registry", "serve", "--bind", "udp://127.0.0.1:5603"), 2, "is not an endpoint to listen on"),
    (("registry", "serve", "--secret-file", "/nonexistent/secret"), 2, "cannot read the secret file"),
    (("bench", "registry", "--clients", "0"), 2, "argument --clients: must be at least 1, got 0"),
    (("bench", "registry", "--seconds", "0"), 2, "argument --seconds: must be above 0"),
    (("registry",), 2, "the following arguments are required: registry_command"),
    (("status", "--timeout", "-1"), 2, "argument --timeout: must be above 0"),
    (("status", "--watch", "0"), 2, "argument --watch: must be above 0"),
    (("status", "--watch", "nan"), 2, "argument --watch: must be a finite number of seconds, got nan"),
    (("registry", "serve", "--liveness-ttl", "inf"), 2, "argument --liveness-ttl: must be a finite number of seconds"),
    (("status", "--watch", "--json"), 2, "--watch draws a live table and --json prints one object: pass one"),
    (("drivers", "--bogus"), 2, "unrecognized arguments: --bogus"),
    (("nope",), 2, "argument command: invalid choice: 'nope'"),
    ((), 2, "the following arguments are required: command"),
]


@pytest.mark.parametrize(("args", "status", "says"), FAILURES, ids=[" ".join(a) or "(none)" for a, _, _ in FAILURES])
def test_a_wrong_command_line_is_one_error_line_and_exit_2(args, status, says):
    proc = run(*args)
    assert proc.returncode == status, proc.stderr
    assert says in one_error_line(proc)
    assert proc.stdout == "" or "--json" in args


@pytest.mark.parametrize(
    "args", [("demo", "--size-mib", "0"), ("status", "--watch", "--json"), ("bench", "model", "--transport", "nope")]
)
def test_with_json_the_error_is_also_a_json_object_on_stdout(args):
    proc = run(*args, "--json")
    line = one_error_line(proc)
    error = json.loads(proc.stdout)["error"]
    assert error["type"] == "UsageError" and error["exit_status"] == proc.returncode == 2
    assert f"error: {error['message']}" == line


def test_the_registry_asks_how_clients_authenticate_and_dev_mode_refuses_a_public_address():
    proc = run("registry", "serve", secret=None)
    assert proc.returncode == 2 and "say how clients authenticate: --keys DIR --server-key FILE" in one_error_line(proc)
    proc = run("registry", "serve", "--insecure-dev", "--bind", "tcp://0.0.0.0:0", secret=None)
    assert proc.returncode == 2
    assert "refusing to serve on tcp://0.0.0.0:0 without authentication" in one_error_line(proc)
    proc = run("registry", "serve", "--insecure-dev", "--keys", "k", "--server-key", "k/s", secret=None)
    assert proc.returncode == 2 and "pass one" in one_error_line(proc)


@pytest.mark.skipif(not UNAVAILABLE, reason="every driver loads here")
@pytest.mark.parametrize("command", [("demo",), ("bench", "pull", "--size", "1M")])
def test_a_driver_that_cannot_load_names_why_and_what_to_do(command):
    proc = run(*command, "--transport", UNAVAILABLE[0])
    assert proc.returncode == 1
    line = one_error_line(proc)
    assert f"transport {UNAVAILABLE[0]!r}" in line and "`weightpull drivers` lists those that load here" in line


def test_status_with_nothing_listening_fails_in_one_line_and_in_json():
    address = free_address()
    proc = run("status", "--registry", address, "--timeout", "0.3", "--json")
    assert proc.returncode == 1
    line = one_error_line(proc)
    assert f"the registry at {address} did not answer status within 0.3 s" in line
    assert "is `weightpull registry serve` running there?" in line
    error = json.loads(proc.stdout)["error"]
    assert error["type"] == "RegistryUnavailableError" and f"error: {error['message']}" == line


def test_status_looks_where_registry_serve_binds_by_default():
    from weightpull.drivers.zmq_registry.server import DEFAULT_BIND

    proc = run("status", "--timeout", "0.3")
    # Nothing listens there in a test run, or something does: either way that is where it looked.
    assert DEFAULT_BIND in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert "tcp://127.0.0.1:5555" in run("registry", "serve", "--help").stdout


def _ctrl_c_stops() -> None:
    """In the child: Ctrl-C (SIGINT) as a terminal delivers it, even where this test runs as
    a background job, whose children start with it ignored (and Python then never raises
    KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Served:
    """`registry serve --json` on a free port: its ready line, parsed."""

    def __enter__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weightpull", "registry", "serve", "--bind", "tcp://127.0.0.1:0", "--json"],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_ctrl_c_stops,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        assert ready, "no ready line within 60 s"
        self.ready = json.loads(self.proc.stdout.readline())
        self.address = self.ready["listening"]
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGINT)
        self.out, self.err = self.proc.communicate(timeout=20)


def test_registry_serve_json_ready_line_and_a_busy_port():
    with Served() as served:
        assert served.ready["pid"] == served.proc.pid and served.ready["run"]
        assert served.address.startswith("tcp://127.0.0.1:")
        busy = run("registry", "serve", "--bind", served.address, "--json")
        assert busy.returncode == 1
        line = one_error_line(busy)
        assert f"cannot bind {served.address}: Address already in use" in line and "pick a free port" in line
        assert json.loads(busy.stdout)["error"]["type"] == "RegistryError"
        shown = run("status", "--registry", served.address, "--json")
        assert shown.returncode == 0 and json.loads(shown.stdout)["run"] == served.ready["run"]
    assert served.proc.returncode == 0 and "Traceback" not in served.err


def test_a_closed_stdout_ends_quietly():
    with Served() as served:
        for args in (("drivers",), ("status", "--registry", served.address), ("drivers", "--json")):
            read, write = os.pipe()
            os.close(read)  # the reader is gone before the first byte: like `| head -0`
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "weightpull", *args],
                    env=env(),
                    stdout=write,
                    stderr=subprocess.PIPE,
                    text=True,
                    timeout=60,
                )
            finally:
                os.close(write)
            assert proc.returncode == 141 and proc.stderr == "", (args, proc.stderr)


@pytest.mark.parametrize("terminal", [True, False], ids=["live table", "plain blocks"])
def test_status_watch_reads_again_until_ctrl_c(terminal):
    from weightpull.integrations.bench.registry import publish_one

    with Served() as served:
        # rich draws live only on a terminal; these tell it the pipe is one. Else: a block per read.
        tty = {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"} if terminal else {}
        proc = subprocess.Popen(
            [sys.executable, "-m", "weightpull", "status", "--registry", served.address, "--watch", "0.2"],
            env=env(**tty),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_ctrl_c_stops,
        )
        seen = ""
        deadline = time.monotonic() + 60
        while "newest READY: none" not in seen and time.monotonic() < deadline:
            seen += os.read(proc.stdout.fileno(), 65536).decode()
        anyio.run(publish_one, served.address, SECRET)  # the next redraw must show it
        while "newest READY: v1" not in seen and time.monotonic() < deadline:
            seen += os.read(proc.stdout.fileno(), 65536).decode()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    assert "newest READY: v1" in seen, seen
    assert ("\x1b[" in seen) is terminal  # rich's cursor moves, on a terminal only
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_version_is_the_package_metadata():
    proc = run("--version")
    assert proc.returncode == 0
    assert proc.stdout == f"weightpull {importlib.metadata.version('weightpull')}\n"
    assert weightpull.__version__ == importlib.metadata.version("weightpull")


def test_the_fake_transport_across_processes_says_it_works_in_one_process_only():
    export = (
        "import sys; from weightpull import create_transport; t = create_transport('fake'); "
        "sys.stdout.write(t.export(t.register(bytearray(16))).decode())"
    )
    descriptor = subprocess.run([sys.executable, "-c", export], capture_output=True, check=True, timeout=60).stdout
    transport = weightpull.create_transport("fake")
    with pytest.raises(PeerGoneError, match="the fake transport works within one process only"):
        transport.connect(descriptor)


# (module made unimportable, arguments, what the error line must say)
MISSING = [
    ("torch", ("demo", "--transport", "fake"), "weightpull demo needs torch: pip install 'weightpull[torch]'"),
    (
        "torch",
        ("bench", "model", "--preset", "tiny"),
        "weightpull bench model needs the torch extra: pip install 'weightpull[torch]'",
    ),
    ("torch", ("bench", "gpu"), "weightpull bench gpu needs the torch extra: pip install 'weightpull[torch]'"),
    ("zmq", ("registry", "serve"), "serving the registry needs the service extra: pip install 'weightpull[service]'"),
    (
        "zmq",
        ("bench", "registry"),
        "weightpull bench registry needs the service extra: pip install 'weightpull[service]'",
    ),
    ("zmq", ("status",), "status needs the service extra: pip install 'weightpull[service]'"),
    ("rich", ("status", "--watch"), "status --watch needs the service extra: pip install 'weightpull[service]'"),
]


@pytest.mark.parametrize(("module", "args", "says"), MISSING, ids=[f"{m}: {' '.join(a)}" for m, a, _ in MISSING])
def test_a_missing_extra_is_named_with_its_pip_command(module, args, says):
    code = (
        f"import sys; sys.modules[{module!r}] = None; from weightpull.integrations.cli import main; "
        f"sys.exit(main({list(args)!r}))"
    )  # None in sys.modules: `import` fails as if not installed
    proc = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert says in one_error_line(proc)


def test_registry_bench_against_a_registry_with_nothing_to_lease():
    with Served() as served:
        proc = run("bench", "registry", "--registry", served.address, "--seconds", "0.2", "--json")
    assert proc.returncode == 1
    assert f"the registry at {served.address} has none: publish one first" in one_error_line(proc)
    assert json.loads(proc.stdout)["error"]["type"] == "NoReadyVersionError"

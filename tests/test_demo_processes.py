"""No process a demo or a bench started outlives it when it is stopped as a user stops it:
SIGINT or SIGTERM sent to its process group (as a terminal's Ctrl-C, or `kill -TERM
-PGID`) or to its main process alone (issue 29, item 4). Processes in sessions of their
own count (the loop's registry and rollout workers), and so do those a library starts
(vLLM's engines).

Each command runs as a terminal job under a subreaper (tests/reaper.py), so that every
process it started is found below it, however far it went: a session of its own, or an
orphan of a child that died. (/proc/PID/environ cannot tell them: vLLM's engines rename
themselves over it.)
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from .reaper import Job, below

pytestmark = pytest.mark.slow
NIXL_DEMO = ("demo", "--transport", "nixl", "--size-mib", "16", "--versions", "4")
LOOP_DEMO = ("demo", "--engine", "vllm", "--trainer", "fsdp")
VLLM_DEMO = ("demo", "--engine", "vllm", "--versions", "3")


def _serving(job: Job) -> bool:
    return any("registry serve" in cmd for cmd in below(job.pid).values())


CASES = [
    # (the command, when to stop it, whom to send it to, the signal)
    pytest.param(NIXL_DEMO, "published v1", "group", signal.SIGTERM, id="nixl-demo-group-sigterm"),
    # the registry and the rollout workers, each in a session of its own, vLLM importing
    pytest.param(LOOP_DEMO, "starting 2 vLLM replicas", "group", signal.SIGTERM, id="loop-demo-group-sigterm"),
    pytest.param(LOOP_DEMO, "starting 2 vLLM replicas", "group", signal.SIGINT, id="loop-demo-group-sigint"),
    # vLLM's engine processes, in the demo's own process group
    pytest.param(VLLM_DEMO, "engine up", "pid", signal.SIGTERM, id="vllm-demo-pid-sigterm"),
    pytest.param(("bench", "registry", "--seconds", "60"), _serving, "pid", signal.SIGTERM, id="bench-pid-sigterm"),
]


@pytest.mark.parametrize(("args", "ready", "whom", "sig"), CASES)
def test_a_stopped_demo_leaves_no_process_behind(args, ready, whom, sig):
    job = Job(args)
    try:
        job.until(ready)
        time.sleep(1.0)  # what it starts next is under way
        running = below(job.reaper.pid)
        (os.killpg if whom == "group" else os.kill)(job.pid, sig)
        status = job.exit_status()
        left = job.left(within=5.0)
        assert not left, f"{len(left)} of the {len(running)} processes outlived it: {left}\n{job.output()}"
        # Stopped in order, as by Ctrl-C: the command's own clean-up ran, and it says so.
        assert status == 130 and "interrupted\n" in job.stderr, (status, job.output())
    finally:
        job.close()

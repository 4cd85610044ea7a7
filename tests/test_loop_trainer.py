"""A loop trainer rank whose publish fails ends at once, saying why in one line, and the
loop names the rank and the reason (issue 29, item 3): it used to go on with no version
(`StalenessClock(now=None)`), then hang at exit on its publisher's background thread,
the demo waiting on it.

The two FSDP2 ranks run as the demo runs them, against a served, keyed registry that
refuses their first version: the trainer's record of the numbers it asked for says
2**40, and a publisher may not ask that far past its last.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")

from weightpull.integrations.loop.demo import LoopDemoError, _Trainer  # noqa: E402
from weightpull.integrations.loop.settings import LoopConfig, Paths  # noqa: E402
from weightpull.integrations.processes import Children  # noqa: E402
from weightpull.rl.ledger import Ledger  # noqa: E402

from .served import ServedRegistry, make_keys  # noqa: E402

pytestmark = pytest.mark.slow
FAR = 2**40


def test_a_rank_whose_publish_fails_exits_at_once_and_the_loop_says_which_and_why(tmp_path, capfd):
    keys = make_keys(tmp_path / "keys", ("publisher", "trainer"))
    registry = ServedRegistry(tmp_path, keys=keys)
    registry.start()
    paths = Paths(tmp_path / "run")
    paths.checkpoint.mkdir(parents=True)
    Ledger.open(paths.ledger, max_inflight=8).close()
    (paths.checkpoint / "asked").write_text(str(FAR))
    cfg = LoopConfig(steps=4, warmup_steps=1)
    env = {"WEIGHTPULL_KEY": str(keys / "trainer.key_secret"), "WEIGHTPULL_SERVER_KEY": str(keys / "registry.key")}
    try:
        with Children() as children:
            trainer = _Trainer(children, cfg, paths, registry.address, 1, env)
            deadline = time.monotonic() + 120
            while trainer.running():  # each rank ends by itself: neither waits on the other
                assert time.monotonic() < deadline, "a rank whose publish failed did not exit"
                time.sleep(0.1)
            assert [p.returncode for p in trainer.procs] == [1, 1]
            with pytest.raises(LoopDemoError) as failed:
                trainer.check()
    finally:
        registry.stop()
    message = str(failed.value)
    assert message.startswith("trainer rank 0 (run 1, pid ") and "\n" not in message
    assert f"rank 0's publish of v{FAR + 1} failed: InvalidArgumentError: version {FAR + 1}" in message, message
    err = capfd.readouterr().err  # the ranks' stderr is this process's
    lines = [line for line in err.splitlines() if line.startswith("trainer rank ")]
    assert sorted(line.split(":")[0] for line in lines) == [
        "trainer rank 0 (run 1) failed",
        "trainer rank 1 (run 1) failed",
    ]
    assert "Traceback" not in err, err

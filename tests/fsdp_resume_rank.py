"""One rank of a two-rank FSDP2 trainer that is SIGKILLed and restarted, run after run:
test code, run by tests/test_fsdp_resume.py as `python -m tests.fsdp_resume_rank OUT
PORT...` with $RANK, $WORLD_SIZE, $MASTER_ADDR, $WEIGHTPULL_REGISTRY and the trainer's key.

It imports torch and the rest once, then forks one process per port: the runs, each a
process of its own (its memory dies with it), the imports paid once. Run k (from 1) meets
its other rank on the k-th port, says OUT/ready-K-RANK (its pid), then waits for OUT/go-K
before it first speaks to the registry: so the test times each restart against the
registry's liveness TTL to a tenth of a second, whatever the imports cost on a busy
machine. It then publishes version 2k-1 sharded (the weights are a pure function of the
version: `weights`), writes OUT/runK-rankRANK.json, and begins version 2k with rank 1's
copy stalled, so that the version stays WRITING, as a trainer killed mid-publish leaves
it, until it is SIGKILLed.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import anyio
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tests.fsdp_rank import TinyLM


def weights(version: int) -> dict[str, torch.Tensor]:
    """Every tensor of `version`, full and fp32, under its checkpoint name."""
    out = {}
    for i, (name, tensor) in enumerate(TinyLM().state_dict().items()):
        generator = torch.Generator().manual_seed(version * 1000 + i)
        out[name] = torch.randn(tensor.shape, generator=generator)
    return out


def _set(model: torch.nn.Module, version: int) -> None:
    from weightpull.integrations.fsdp import named_state
    from weightpull.sharding import chunk_rows

    full = weights(version)
    with torch.no_grad():
        for name, tensor in named_state(model):
            if isinstance(tensor, DTensor):
                mesh = tensor.device_mesh
                start, stop = chunk_rows(tensor.shape[0], mesh.get_local_rank(), mesh.size())
                tensor.to_local().copy_(full[name][start:stop])
            else:
                tensor.copy_(full[name])


def _stall_next_write() -> None:
    """This rank's next copy into its slot never ends: its shard stays WRITING."""
    from weightpull.integrations import torch_tensors

    async def stalled(self, items, region):
        await anyio.sleep_forever()

    torch_tensors.TorchAdapter.write = stalled


def one_run(out: Path, run: int, version: int) -> None:
    from weightpull.integrations.fsdp import FSDPPublisher

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    model = TinyLM()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    (out / f"ready-{run}-{rank}").write_text(str(os.getpid()))
    while not (out / f"go-{run}").exists():  # silent until the test says: the restart is now
        time.sleep(0.02)
    publisher = FSDPPublisher(model, mode="sharded", transport="nixl", rollout_dtype="bfloat16", name="trainer")
    _set(model, version)
    publisher.publish(version)
    result = publisher.wait()
    report = {"run": run, "rank": rank, "asked": version, "version": None if result is None else result.version}
    (out / f"run{run}-rank{rank}.json").write_text(json.dumps(report))
    if result is None:
        os._exit(1)
    _set(model, version + 1)
    if rank == 1:
        _stall_next_write()
    publisher.publish(version + 1)  # rank 1's copy stalls: the version stays WRITING
    while True:  # the slots stay readable until the test SIGKILLs us
        time.sleep(1)


def main(out: Path, ports: list[str]) -> None:
    import weightpull.drivers.nixl  # noqa: F401  (imported before the forks: paid once)
    import weightpull.drivers.zmq_registry.client  # noqa: F401
    import weightpull.integrations.fsdp  # noqa: F401

    children = []
    for k, port in enumerate(ports, start=1):
        pid = os.fork()
        if pid == 0:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the test's handle
            os.environ["MASTER_PORT"] = port
            try:
                one_run(out, k, 2 * k - 1)
            except BaseException:
                traceback.print_exc()
            os._exit(1)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])

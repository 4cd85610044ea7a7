"""One rank of an FSDP2 job that trains a tiny Llama with tied embeddings (transformers'
own model) and publishes through `FSDPPublisher`, under checkpoint names (the embedding
once, no `lm_head.weight`): test code, run by tests/test_vllm_apply.py as
`python -m tests.fsdp_tied_rank OUT` with torchrun's environment and $WEIGHTPULL_REGISTRY.

It publishes v0 at start and v1, v2 after two optimizer steps, then rank 0 saves v2's
full weights as a bf16 checkpoint in OUT/expected (gathered apart from any publish), and
every rank writes OUT/rank{r}.json and stays alive (its slots hold what replicas read)
until OUT/done appears.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from weightpull.integrations.fsdp import FSDPPublisher, named_state
from weightpull.integrations.vllm.tiny import make_model, save

STEPS = 2


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    model = make_model("llama-tied").train()  # seeded: the same on every rank
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    publisher = FSDPPublisher(model, transport="nixl", name="trainer", num_slots=2)
    hook = publisher.attach(optimizer)  # v0 now, then one version per step
    tokens = torch.randint(0, model.config.vocab_size, (STEPS, 4, 16), generator=torch.Generator().manual_seed(1))
    for step in range(STEPS):
        loss = model(input_ids=tokens[step], labels=tokens[step]).loss
        loss.backward()
        optimizer.step()  # its hook publishes
        optimizer.zero_grad()
    hook.remove()
    publisher.wait()
    names = [name for name, _ in named_state(model)]
    full = {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in named_state(model)}
    if rank == 0:
        reference = make_model("llama-tied")
        missing, unexpected = reference.load_state_dict(full, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        save(reference, out / "expected")
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "names": names, "version": STEPS}))
    while not (out / "done").exists():
        time.sleep(0.05)
    publisher.close()
    os._exit(0)  # the process group may be broken: skip its teardown


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""Registers the `weightpull` backend with vLLM's weight-transfer factories.

vLLM calls `register` in each of its processes (the `vllm.general_plugins` entry point
that `pip install weightpull[vllm]` installs), so `--weight-transfer-config
'{"backend": "weightpull"}'` resolves in every worker. Importing
`weightpull.integrations.vllm.trainer` registers the trainer's side too, for a trainer
process in which vLLM loads no plugins. The engines' modules load only when used.
"""

from __future__ import annotations

BACKEND = "weightpull"


def register() -> None:
    """Register both sides under "weightpull"; a second call does nothing."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, module, name in (
        (WeightTransferEngineFactory, "weightpull.integrations.vllm.backend", "WeightpullTransferEngine"),
        (WeightTransferTrainerFactory, "weightpull.integrations.vllm.trainer", "WeightpullTrainerEngine"),
    ):
        try:
            factory.register_engine(BACKEND, module, name)
        except ValueError:  # registered already (vLLM loads plugins more than once per process)
            pass

"""The decoupled RL loop, end to end (docs/guides/loop.md): a two-rank FSDP2 trainer that only
publishes and enqueues, vLLM replicas that pull, apply and claim prompts on their own,
a prompt ledger that survives any process's death, and the demo that runs them all."""

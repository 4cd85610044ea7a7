"""`weightpull bench`: every figure weightpull publishes about itself, one module each.

| command | module | what |
|---|---|---|
| `weightpull bench pull` | `pull` | one byte stream's pull bandwidth, against the driver's raw read and the copy limit |
| `weightpull bench model` | `model` (`flow`, `baselines`, `presets`) | a model-shaped set: trainer block, pull, apply pause, publish to serving, beside the limits and the pushes |
| `weightpull bench gpu` | `gpu` | GPU pulls of an 8B-shaped set (cuda_ipc; host to GPU), and the vLLM apply check's cost |
| `weightpull bench fsdp` | `fsdp` | how long publishing blocks an FSDP2 trainer |
| `weightpull bench registry` | `registry` | a served registry's lease round trips |

Shared by all: `child` (the trainer's or publisher's process), `limits` (the machine's
copies, measured in the same run), `raw` (the same bytes without weightpull) and `util`.
Importing this package imports nothing heavy; each module imports what its figure needs
(torch, zmq) and the core never imports any of them.
"""

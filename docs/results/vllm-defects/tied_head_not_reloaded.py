"""vLLM defect: a tied LM head is not reloaded on the CPU backend.

A Llama with `tie_word_embeddings=True`, updated through the worker's layerwise
`reload_weights(..., is_checkpoint_format=True)` with the weights as `save_pretrained`
writes them (no `lm_head.weight`): the reload gives `ParallelLMHead` no weights, logs
"ParallelLMHead: Failed to load weights" and puts its old tensors back. On the CPU backend
the head computes from a copy packed for oneDNN at start-up, so the engine serves the new
body with the first version's head. Prints DIFFERS (the defect) or SAME.
Run beside reload_vs_fresh.py: python tied_head_not_reloaded.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from reload_vs_fresh import main  # noqa: E402

if __name__ == "__main__":
    main("llama", tie=True, names="checkpoint")

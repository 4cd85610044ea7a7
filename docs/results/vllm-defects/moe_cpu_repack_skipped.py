"""vLLM defect: on a weight update the CPU backend's fused experts are not repacked.

A Qwen3-MoE updated through the worker's layerwise `reload_weights(...,
is_checkpoint_format=True)`: `UnquantizedFusedMoEMethod._setup_kernel` treats the reload as
a weight update (`moe_kernel` is set) and skips `moe_kernel.fused_experts.
process_weights_after_loading(layer)`, which on CPU prepacks w13/w2 into the grouped-gemm
layout (`cpu_prepack_moe_weight`). The experts keep raw, unpacked values that the kernel
reads as packed. Prints DIFFERS (the defect) or SAME.
Run beside reload_vs_fresh.py: python moe_cpu_repack_skipped.py [--names state_dict]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from reload_vs_fresh import main  # noqa: E402

if __name__ == "__main__":
    main(
        "qwen3_moe",
        tie=False,
        names="state_dict" if "--names=state_dict" in sys.argv or "state_dict" in sys.argv else "checkpoint",
    )

"""Deprecated: the GPU bench is `weightpull bench gpu`, its code
`weightpull.integrations.bench.gpu`. This module path goes in a later release."""

import sys
import warnings

from weightpull.integrations.bench.gpu import (  # noqa: F401  (the names this path offered)
    PublisherProcess,
    bench_apply_check,
    bench_cuda_ipc,
    bench_host_to_gpu,
    checksums,
    copy_seconds,
    make_tensors,
    mirror_checksums,
    qwen3_8b_shapes,
    run,
)


def main(argv: list[str] | None = None) -> int:
    from weightpull.integrations.cli import main as cli

    return cli(["bench", "gpu", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.stderr.write(
        "warning: `python -m weightpull.integrations.gpu_bench` is deprecated and goes in a later "
        "release: write `weightpull bench gpu`\n"
    )
    sys.exit(main())
else:
    warnings.warn(
        "weightpull.integrations.gpu_bench is deprecated: import weightpull.integrations.bench.gpu "
        "(`weightpull bench gpu` runs it)",
        DeprecationWarning,
        stacklevel=2,
    )

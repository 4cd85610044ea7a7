"""Deprecated: the FSDP blocking bench is `weightpull bench fsdp`, its code
`weightpull.integrations.bench.fsdp`. This module path goes in a later release."""

import sys
import warnings

from weightpull.integrations.bench.fsdp import run  # noqa: F401  (the names this path offered)
from weightpull.integrations.bench.presets import qwen3_shaped  # noqa: F401
from weightpull.integrations.bench.util import PinnedFake  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    from weightpull.integrations.cli import main as cli

    return cli(["bench", "fsdp", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.stderr.write(
        "warning: `python -m weightpull.integrations.fsdp_bench` is deprecated and goes in a later "
        "release: write `weightpull bench fsdp`\n"
    )
    sys.exit(main())
else:
    warnings.warn(
        "weightpull.integrations.fsdp_bench is deprecated: import weightpull.integrations.bench.fsdp "
        "(`weightpull bench fsdp` runs it)",
        DeprecationWarning,
        stacklevel=2,
    )

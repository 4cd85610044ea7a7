"""The driver conformance suite (`weightpull.drivers.testing.conformance_suite`, shipped so
third-party drivers run it too) against this project's drivers: fake and nixl by default,
others by $WEIGHTPULL_DRIVERS (torch in .venv-torch; cuda_ipc on a GPU machine)."""

from weightpull.drivers.testing.conformance_suite import *  # noqa: F403 - the suite's tests and fixtures

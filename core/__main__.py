"""`python -m weightpull`: the command line (`weightpull.integrations.cli`, an application of
the core, loaded by name so that the core imports no integration)."""

import importlib

raise SystemExit(importlib.import_module("weightpull.integrations.cli").main())

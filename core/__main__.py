"""`python -m weightpull`: the command line, the `weightpull` console script that the
package's metadata names (an application of the core, so found by name: the core imports
no integration)."""

from weightpull import plugins

raise SystemExit(plugins.load_builtin("console_scripts", "weightpull", "the weightpull command")())

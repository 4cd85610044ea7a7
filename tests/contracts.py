"""An import-linter contract that also sees imports by string (pyproject's `contract_types`).

`forbidden` contracts see import statements only; code that loads a module by name
(`importlib.import_module("weightpull.integrations.cli")`, an import string
`"weightpull.drivers.nixl:NixlTransport"` handed to a loader) slips past them. This
contract is a `forbidden` one whose source is every module its `source_modules` match
less those that are forbidden themselves (so `weightpull.**` is the whole core, new
modules included, though `weightpull.drivers` lies inside `weightpull`), and which also
reads each source module's code for string constants naming a forbidden module, in any
form (`a.b`, `a.b.c`, `a.b:C`, `a.b:C [extra]`), reported as file:line.

It lives with the tests, not in the package it checks; `lint-imports` finds it because it
puts its working directory (the repository's root) on `sys.path`.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from grimp import ImportGraph
from importlinter.application import output
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.domain import fields
from importlinter.domain.contract import ContractCheck, InvalidContractOptions
from importlinter.domain.helpers import module_expressions_to_modules
from importlinter.domain.imports import ModuleExpression

_NAME = r"[A-Za-z_]\w*"


def names_pattern(forbidden: Iterable[str]) -> re.Pattern[str]:
    """What a string naming one of the `forbidden` modules (or anything in them) looks like:
    the whole string is the module's dotted name, optionally a deeper one, an attribute after
    a colon and an entry point's extras."""
    roots = sorted({f.removesuffix(".**").removesuffix(".*") for f in forbidden})
    alternatives = "|".join(re.escape(r) for r in roots)
    return re.compile(rf"\s*(?:{alternatives})(?:\.{_NAME})*(?::\s*{_NAME}(?:\.{_NAME})*)?(?:\s*\[[\w\s,.-]*\])?\s*")


def strings_naming(source: str, pattern: re.Pattern[str]) -> Iterator[tuple[int, str]]:
    """(line, string) of each string constant in `source` that names a module `pattern` matches
    (f-strings' literal parts included)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.fullmatch(node.value):
            yield node.lineno, node.value.strip()


def module_file(name: str) -> Path | None:
    """The source file of module `name`, found without importing it (importing a package
    would run its code, and the point is to read code that may be broken)."""
    root, *rest = name.split(".")
    spec = importlib.util.find_spec(root)
    if spec is None or not spec.submodule_search_locations:
        return Path(spec.origin) if spec is not None and spec.origin and not rest else None
    for location in spec.submodule_search_locations:
        base = Path(location, *rest)
        for candidate in (base / "__init__.py", base.with_suffix(".py")) if rest else (base / "__init__.py",):
            if candidate.is_file():
                return candidate
    return None


def shown(path: Path) -> str:
    """`path` as a reader finds it: the real file (a link tree's target), from the working directory."""
    real = path.resolve()
    try:
        return str(real.relative_to(Path(os.getcwd()).resolve()))
    except ValueError:
        return str(real)


class ForbiddenEvenByStringContract(ForbiddenContract):
    """`forbidden`, with import strings seen too.

    Configuration options, beyond `forbidden`'s:
        - allowed_strings: entries `"module: string"`, each a string that module may hold (say
          why in a comment beside it). An entry that matches nothing is warned of, so the list
          does not outlive what it excuses.
    """

    type_name = "forbidden_even_by_string"

    allowed_strings = fields.ListField(subfield=fields.StringField(), required=False)

    def validate(self) -> None:
        super().validate()
        for entry in self.allowed_strings or ():  # type: ignore[attr-defined]
            if ": " not in entry:
                raise InvalidContractOptions({"allowed_strings": f"{entry!r} is not 'module: string'"})

    def sources(self, graph: ImportGraph) -> list[str]:
        """Every module `source_modules` match that is not forbidden itself."""
        forbidden = {m.name for m in module_expressions_to_modules(graph, self.forbidden_modules)}  # type: ignore[arg-type]
        matched = module_expressions_to_modules(graph, self.source_modules)  # type: ignore[arg-type]
        return sorted(m.name for m in matched if m.name not in forbidden)

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        sources = self.sources(graph)
        self.source_modules = {ModuleExpression(name) for name in sources}  # type: ignore[assignment]
        check = super().check(graph, verbose)

        allowed = {tuple(entry.split(": ", 1)) for entry in self.allowed_strings or ()}  # type: ignore[attr-defined]
        pattern = names_pattern(str(f) for f in self.forbidden_modules)  # type: ignore[attr-defined]
        found: list[dict[str, Any]] = []
        used: set[tuple[str, str]] = set()
        for name in sources:
            path = module_file(name)
            if path is None:
                raise ValueError(f"no source file found for module {name!r}")
            for line, string in strings_naming(path.read_text(encoding="utf-8"), pattern):
                if (name, string) in allowed:
                    used.add((name, string))
                else:
                    found.append({"module": name, "file": shown(path), "line": line, "string": string})
        check.metadata["strings"] = sorted(found, key=lambda hit: (hit["file"], hit["line"]))
        check.kept = check.kept and not found
        # A stale entry warns rather than breaks: a string may move between modules in one change.
        check.warnings.extend(
            f"allowed_strings entry '{m}: {s}' matches no string: remove it" for m, s in sorted(allowed - used)
        )
        return check

    def render_broken_contract(self, check: ContractCheck) -> None:
        super().render_broken_contract(check)
        for hit in check.metadata["strings"]:
            output.print_error(
                f"{hit['file']}:{hit['line']}: {hit['module']} names {hit['string']!r} by a string (load it through an entry point)",
                bold=False,
            )
        if check.metadata["strings"]:
            output.new_line()

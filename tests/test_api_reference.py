"""The API reference (docs/reference/*.md, rendered by mkdocstrings) names every public
name: each of `weightpull.__all__`, every error of `weightpull.errors` and each of
`weightpull.rl.__all__` appears in a `::: path` directive, by itself or through the module
that defines it, so a new public name cannot be left out of the reference. (`make test`
builds the site with --strict: that the docstrings render is checked there.)"""

import importlib
import inspect
import re
from pathlib import Path

import pytest

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference"
DIRECTIVE = re.compile(r"^::: (\S+)\n((?:[ \t]+\S.*\n)*)", re.M)
MEMBERS = re.compile(r"^\s+members:\s*\[(.*)\]", re.M)


def directives() -> dict[str, set[str] | None]:
    """Each directive's path, with the members it is limited to (None: all of them)."""
    found: dict[str, set[str] | None] = {}
    for page in REFERENCE.glob("*.md"):
        for path, options in DIRECTIVE.findall(page.read_text()):
            limit = MEMBERS.search(options)
            found[path] = {m.strip() for m in limit.group(1).split(",")} if limit else None
    return found


def covered(name: str, obj: object, package: str, found: dict[str, set[str] | None]) -> bool:
    module = getattr(obj, "__module__", None)
    if f"{package}.{name}" in found or f"{module}.{name}" in found:
        return True
    members = found.get(module, False) if module else False
    return members is None or (members is not False and name in members)


def public(module_name: str) -> list[tuple[str, object]]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:  # a module without __all__: the classes it defines
        names = [
            n for n, v in vars(module).items() if inspect.isclass(v) and v.__module__ == module_name and n[0] != "_"
        ]
    return [(n, getattr(module, n)) for n in names]


@pytest.mark.parametrize("package", ["weightpull", "weightpull.errors", "weightpull.rl"])
def test_every_public_name_is_in_the_reference(package):
    found = directives()
    missing = [name for name, obj in public(package) if not covered(name, obj, package, found)]
    assert not missing, f"add a `::: {package}.NAME` directive to a page of docs/reference for each"


def test_a_name_left_out_is_caught():
    found = directives()
    found.pop("weightpull.Publisher")
    import weightpull

    assert not covered("Publisher", weightpull.Publisher, "weightpull", found)


def test_every_directive_names_a_reference_page_in_the_nav():
    nav = (REFERENCE.parents[1] / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in REFERENCE.glob("*.md"))
    assert [p for p in pages if f"reference/{p}" not in nav] == []

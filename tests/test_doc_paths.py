"""Every path into docs/ that the code, the tests and the docs name exists, and every
relative link of the README, the changelog and docs/ leads to a file: pages that move cannot leave
a CLI hint, a comment or a link pointing at nothing."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMED = re.compile(r"\bdocs/[\w./-]*[\w/]")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
SOURCES = ("README.md", "CHANGELOG.md", "Makefile", "core", "drivers", "integrations", "tests", "fuzz", "docs")


def files():
    for name in SOURCES:
        path = ROOT / name
        if path.is_file():
            yield path
        else:
            yield from (p for p in path.rglob("*") if p.suffix in {".py", ".md", ".sh"})


def test_every_docs_path_named_exists():
    missing = [
        f"{path.relative_to(ROOT)}: {named}"
        for path in files()
        for named in NAMED.findall(path.read_text())
        if not (ROOT / named).exists()
    ]
    assert not missing


def test_every_relative_link_of_the_readme_the_changelog_and_the_docs_leads_to_a_file():
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")]
    broken = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in pages
        for target in LINK.findall(page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert not broken

"""The README and docs/ point only at what exists: every relative link resolves (its #anchor to a heading of the
page linked), and every repository path they name in backticks is in the repository, so a moved module or a renamed
heading fails here rather than in a reader's browser."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP = ("reshard/", "converters/", "trainer/", "fixtures/", "tests/", "scripts/", "benchmarks/", "docs/")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")


def prose(page: Path) -> str:
    """The page without its fenced code blocks (a command line there is not a reference)."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation other than - and _ dropped, spaces to -."""
    headings = re.findall(r"^#+\s+(.*)$", prose(page), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_docs_exist():
    assert len(PAGES) > 1 and all(p.is_file() for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):
            continue  # an address outside the repository
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(target)
    assert broken == [], f"{page.relative_to(REPO)} links to what does not exist: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_repository_path_named_exists(page):
    named = {m.split("::")[0] for m in CODE.findall(prose(page)) if m.startswith(TOP) and not re.search(r"[*{<\[]", m)}
    assert sorted(n for n in named if not (REPO / n).exists()) == [], f"{page.relative_to(REPO)} names paths that do not exist"

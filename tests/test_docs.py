"""The docs hold together: every relative link in README.md and docs/ (the lab notebook included) names a
file of the checkout, and a link to a section of a Markdown file names a heading it has; and no user page
depends on the lab notebook (docs/lab/): a user page may point at its index, docs/lab/README.md, for the
history, and at nothing else there, so that whatever a user needs is stated on the user pages."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAB = "docs/lab"
LAB_INDEX = "docs/lab/README.md"

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LAB_MENTION = re.compile(r"(?<![\w/.-])(?:docs/)?lab/(?!README\.md\b)[\w./-]*[\w/]")
"""A path into the lab in a user page's text (docs/lab/x, lab/x), its index aside."""


def user_pages(root: Path = ROOT) -> list[Path]:
    """README.md and the Markdown files directly under docs/: what a user reads."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def lab_pages(root: Path = ROOT) -> list[Path]:
    return sorted((root / LAB).rglob("*.md"))


def unfenced(text: str) -> str:
    """``text`` with its fenced code blocks blanked (a heading or link there is not one)."""
    kept: list[str] = []
    fence = ""
    for line in text.splitlines():
        opened = FENCE.match(line)
        if fence:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = ""
            kept.append("")
        elif opened:
            fence = opened.group(1)
            kept.append("")
        else:
            kept.append(line)
    return "\n".join(kept)


def prose(text: str) -> str:
    """``text`` without its fenced code blocks and code spans (a link there is not one)."""
    return CODE_SPAN.sub(lambda span: " " * len(span.group(0)), unfenced(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: its rendered text lowercased, punctuation dropped, spaces as
    hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[`*]|<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (a repeated one numbered as GitHub numbers it)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in unfenced(page.read_text(encoding="utf-8")).splitlines():
        heading = HEADING.match(line)
        if not heading:
            continue
        base = slug(heading.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> Iterator[str]:
    """The targets of ``page``'s relative links (images too)."""
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, mailto:, ...
            yield target


def broken_links(pages: list[Path], root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(page, link, what is wrong) for each relative link of ``pages`` that names no file of ``root``, or
    no heading of the Markdown file it names."""
    broken: list[tuple[str, str, str]] = []
    for page in pages:
        for target in links(page):
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            name = page.relative_to(root).as_posix()
            if not where.exists():
                broken.append((name, target, "no such file"))
            elif not where.resolve().is_relative_to(root.resolve()):
                broken.append((name, target, "outside the checkout"))
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                broken.append((name, target, "no such heading"))
    return broken


def into_the_lab(pages: list[Path], root: Path = ROOT) -> list[tuple[str, str]]:
    """(page, link or mention) for each link of ``pages`` into docs/lab/ other than its index, and each
    path into docs/lab/ their text names."""
    lab, index = (root / LAB).resolve(), (root / LAB_INDEX).resolve()
    found: list[tuple[str, str]] = []
    for page in pages:
        name = page.relative_to(root).as_posix()
        for target in links(page):
            path = target.partition("#")[0]
            where = (page.parent / path).resolve() if path else page.resolve()
            if where.is_relative_to(lab) and where != index:
                found.append((name, target))
        text = LINK.sub(" ", page.read_text(encoding="utf-8"))  # (a link's target is looked at above)
        found.extend((name, mention) for mention in LAB_MENTION.findall(text))
    return found


def test_every_relative_link_of_the_docs_resolves() -> None:
    assert broken_links(user_pages() + lab_pages()) == []


def test_the_lab_has_an_index_and_no_user_page_depends_on_the_rest_of_it() -> None:
    assert (ROOT / LAB_INDEX).is_file()
    assert into_the_lab(user_pages()) == []


def test_the_checks_bite(tmp_path: Path) -> None:
    # A missing file, a missing heading, a link into the lab past its index, a lab path in the text; and
    # not a link in code, a link to a heading that is there, to the lab's index, or to a web page.
    (tmp_path / "docs" / "lab").mkdir(parents=True)
    (tmp_path / "docs" / "lab" / "README.md").write_text("# The lab\n")
    (tmp_path / "docs" / "lab" / "runs.md").write_text("# Runs\n\n## Run 1 — 2026-11-29, `tests/gpu`\n")
    (tmp_path / "README.md").write_text(
        "# Top\n\n## 5. Cost (issue 16)\n\nSee [cost](#5-cost-issue-16), [the lab](docs/lab/README.md),\n"
        "[a page](https://example.com/x.md), `[code](nowhere.md)` and\n```\n[fenced](nowhere.md)\n```\n"
        "[gone](docs/gone.md), [run 1](docs/lab/runs.md#run-1--2026-11-29-testsgpu), [bad](#6-cost).\n")
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\n## Page\n\n[second](#page-1) [up](../README.md#top)\nas recorded in docs/lab/runs.md\n")
    pages = user_pages(tmp_path)
    assert broken_links(pages + lab_pages(tmp_path), tmp_path) == [
        ("README.md", "docs/gone.md", "no such file"), ("README.md", "#6-cost", "no such heading")]
    assert into_the_lab(pages, tmp_path) == [
        ("README.md", "docs/lab/runs.md#run-1--2026-11-29-testsgpu"), ("docs/page.md", "docs/lab/runs.md")]

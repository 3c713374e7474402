"""The docs hold together, and the user pages say what is true now.

Every relative link of the Markdown pages (README.md, CHANGELOG.md, docs/, benchmarks/) names a file of the
checkout, and a link to a section of a Markdown file names a heading it has.

The user pages (README.md and docs/*.md) carry no history: no date, no commit hash, no "issue N", no "run
N". What changed goes to the commit messages and CHANGELOG.md; a measured figure's command, machine and date
are in benchmarks/README.md and benchmarks/GPU-RUNS.md, which a page points to. The rule is strict: a date or
a hash is refused in example output (fenced blocks, code spans) too; only a GPU's UUID, which is hex by
nature, is not taken for a hash. CHANGELOG.md may date its releases, and names no issue, commit or run
either: it describes the changes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")

MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t|tember)?"
         r"|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
DAY = r"[0-3]?\d(?:st|nd|rd|th)?"
YEAR = r"(?:19|20)\d\d\b"
DATE = re.compile(rf"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b|\b{MONTH}\.? +(?:{DAY},? +)?{YEAR}"
                  rf"|\b{DAY} +{MONTH}\.?,? +{YEAR}")
"""2026-12-04, Dec 4, 2026, December 2026, 4 December 2026."""
UUID = re.compile(r"\b[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}\b", re.I)
"""A GPU's or a MIG instance's UUID (``GPU-<uuid>``): hex, and no commit."""
COMMIT = re.compile(r"(?<![\w-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")
"""A word of 7 to 40 lowercase hex digits with a letter and a digit among them: a commit's (short) hash, or
a checksum's."""
ISSUE = re.compile(r"\b(?:issues?|PRs?|pull requests?|tickets?)\s+#?\d+|(?<![\w&/#])#\d+\b", re.I)
"""issue 37, issues 27-29, PR 12, #21832 (a link's target, ``(#2-a-session)``, is taken out first)."""
RUN = re.compile(r"\bruns?\s+#?\d+\b(?!\s*(?:in|of|out of|/)\s*\d)"
                 r"(?!\s+(?!(?:and|or|to|showed|printed|found|was|is|had)\b)[a-z])", re.I)
"""run 21, runs 34-37, runs 66 and 68, run 5 showed; not a count ("runs 3 of 4 shards", "runs 1 test in 4").
Looked for in prose only: ``.ci/run 2>&1`` is a command."""


def markdown_pages(root: Path = ROOT) -> list[Path]:
    """The project's Markdown pages: the user pages, CHANGELOG.md and the benchmarks' records."""
    found = [root / "README.md", root / "CHANGELOG.md", *sorted((root / "docs").glob("*.md")),
             *sorted((root / "benchmarks").rglob("*.md"))]
    return [page for page in found if page.is_file()]


def user_pages(root: Path = ROOT) -> list[Path]:
    """README.md and the Markdown files directly under docs/: what a user reads."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


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


def history(page: Path, dates: bool = True, root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(page, line, what) for each date (unless ``dates`` is off), commit hash, issue number and run number
    in ``page``. Dates and hashes are looked for everywhere, examples included; issue numbers once the
    links' targets are out, run numbers in the prose."""
    text = page.read_text(encoding="utf-8")
    everywhere = UUID.sub(lambda uuid: "-" * len(uuid.group(0)), text)
    targets_out = LINK.sub(lambda link: re.sub(r"\]\(.*", "]", link.group(0)), everywhere)
    kinds = ([DATE] if dates else []) + [COMMIT]
    looked = [(pattern, everywhere) for pattern in kinds] + [(ISSUE, targets_out), (RUN, prose(targets_out))]
    name = page.relative_to(root).as_posix()
    found = []
    for pattern, seen in looked:
        for number, line in enumerate(seen.splitlines(), 1):
            found.extend((name, number, match.group(0)) for match in pattern.finditer(line))
    return sorted(found)


def test_every_relative_link_of_the_docs_resolves() -> None:
    assert broken_links(markdown_pages()) == []


def test_the_user_pages_carry_no_dates_hashes_issues_or_runs() -> None:
    assert [found for page in user_pages() for found in history(page)] == []


def test_the_changelog_describes_changes_without_issues_commits_or_runs() -> None:
    assert history(ROOT / "CHANGELOG.md", dates=False) == []


def test_the_link_check_bites(tmp_path: Path) -> None:
    # A missing file, a missing heading; and not a link in code, a link to a heading that is there (a
    # repeated one numbered), to a web page.
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# Top\n\n## 5. Cost (measured)\n\nSee [cost](#5-cost-measured), [a page](https://example.com/x.md),\n"
        "`[code](nowhere.md)` and\n```\n[fenced](nowhere.md)\n```\n[gone](docs/gone.md), [bad](#6-cost).\n")
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\n## Page\n\n[second](#page-1) [up](../README.md#top)\n")
    assert broken_links(markdown_pages(tmp_path), tmp_path) == [
        ("README.md", "docs/gone.md", "no such file"), ("README.md", "#6-cost", "no such heading")]


def test_the_history_check_bites(tmp_path: Path) -> None:
    # Each kind, in prose, in a code span and in a fence; and what is none: a GPU's UUID, a pid, a
    # version, a link to a numbered section, a slice, a command that runs a script, a word of hex letters.
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n"
        "Measured on 2026-12-04 (`f6c231e`), fixed in issue 37 and #21832, as run 21 showed.\n"
        "Runs 34-37 in December 2026, on Dec 4, 2026 and on 4 December 2026; issues 27 and 28.\n"
        "```\nGPU 0 NVIDIA H200 (GPU-64cb74a5-d455-5d50-0387-7279b1639523): 0/143771 MiB used\n"
        "pid 12717 at 2026-11-29 17:02 UTC, sha256 5654f8c5eaa0...\n```\n"
        "torch 2.11.0, vLLM 0.20.2, [section 2](#2-a-session), 1 in 4 runs, `bash .ci/run 2>&1`, a facade.\n"
        "The suite runs 3 of 4 shards; CI runs 1 test in 4; one run of 1,072 tests took 72 s;\n"
        "`run 5` in code.\n"
        "As runs 66 and 68 found, and run 5 showed.\n")
    name = "docs/page.md"
    assert history(page, root=tmp_path) == sorted([
        (name, 3, "2026-12-04"), (name, 3, "f6c231e"), (name, 3, "issue 37"), (name, 3, "#21832"),
        (name, 3, "run 21"), (name, 4, "Runs 34"), (name, 4, "December 2026"), (name, 4, "Dec 4, 2026"),
        (name, 4, "4 December 2026"), (name, 4, "issues 27"), (name, 7, "2026-11-29"),
        (name, 7, "5654f8c5eaa0"), (name, 12, "run 5"), (name, 12, "runs 66")])
    assert not [what for _, _, what in history(page, dates=False, root=tmp_path) if DATE.search(what)]

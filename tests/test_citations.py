"""What the repository cites is in it: every ``NAME.md`` that a tracked file mentions is a file of the
repository. GPU-FACTS.md and RAY-FACTS.md were cited by docs/ci.md, the GPU run log (then docs/gpu.md),
docs/multinode.md, tests/gpu/test_gpu_health.py and two benchmarks, and lived outside it; what they
measured is now stated where it is used, with how it was measured. Recorded output (benchmarks/results/)
stays as it was recorded. (tests/test_docs.py checks the docs' links.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ("benchmarks/results/",)
HERE = ("tests/test_citations.py", "tests/test_docs.py")
"""(Their own mentions are examples of what they look for.)"""
WRITTEN_BY_TESTS = {"step_summary.md", "summary.md"}
"""Files the tests write (a job summary, as GitHub's ``$GITHUB_STEP_SUMMARY``), named by the tests."""
MENTION = re.compile(r"(?<![\w/.-])([\w./-]*[A-Za-z0-9_-]\.md)\b")


def tracked_files() -> list[str]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                                timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [name for name in listed.decode().split("\0") if name]


def cited_but_missing(files: list[str], root: Path = ROOT) -> list[tuple[str, str]]:
    """(file, mention) for each ``*.md`` one of ``files`` (under ``root``) mentions that none is named."""
    present = {Path(name).name for name in files if name.endswith(".md")} | WRITTEN_BY_TESTS
    missing: list[tuple[str, str]] = []
    for name in files:
        if name.startswith(RECORDED) or name in HERE:
            continue
        try:
            text = (root / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # (a binary file)
        missing.extend((name, mention) for mention in MENTION.findall(text)
                       if Path(mention).name not in present)
    return missing


def test_every_markdown_file_the_repository_cites_is_in_it() -> None:
    assert cited_but_missing(tracked_files()) == []


def test_a_citation_of_a_file_outside_the_repository_is_found(tmp_path: Path) -> None:
    # The check bites: the kind of mention it replaced, and not a mention of a file that is there.
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "gpu.md").write_text("the release time matched GPU-FACTS.md; see ci.md\n")
    (tmp_path / "docs" / "ci.md").write_text("not queued behind them (RAY-FACTS.md §6)\n")
    (tmp_path / "benchmarks" / "results" / "run6.log").write_text("# measured in GPU-FACTS.md: 14.8 GB\n")
    files = ["docs/gpu.md", "docs/ci.md", "benchmarks/results/run6.log"]
    assert cited_but_missing(files, tmp_path) == [
        ("docs/gpu.md", "GPU-FACTS.md"), ("docs/ci.md", "RAY-FACTS.md")]

"""README.md's first section ("The first minute"), run as written: its files and commands in a new
directory, and the output it shows checked against what they print.

The README marks what this test takes with an HTML comment right before each fenced block:
``<!-- first-minute: run -->`` (shell commands), ``<!-- first-minute: file NAME -->`` (a file to write) and
``<!-- first-minute: output -->`` (what the commands print; a ``...`` line stands for lines left out).
The ``pip install`` line is not run: the plugin is installed in this venv already (and .ci/package
proves that the built wheel installs and works).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers import TEST_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"^<!-- first-minute: (run|output|file (\S+)) -->\n```[a-z]*\n(.*?)^```$", re.M | re.S)


def first_section(text: str) -> str:
    """The text of the README's first ``## `` section, up to the next one."""
    return re.split(r"^## ", text, flags=re.M)[1]


def normalise(line: str) -> str:
    """What must match of an output line: pids, durations, the simulated GPUs' UUIDs (they derive from the
    directory) and absolute paths vary from run to run; the width of pytest's rules follows the terminal."""
    line = re.sub(r"\bGPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}\b", "GPU-<uuid>", line)
    line = re.sub(r"\bpid \d+", "pid <pid>", line)
    line = re.sub(r"\b\d+\.\d+s\b", "<seconds>", line)
    line = re.sub(r"(?<!\S)/\S*", "<path>", line)
    line = re.sub(r"[=_]{3,}", "<rule>", line)
    return " ".join(line.split())


def missing_lines(shown: str, printed: str) -> list[str]:
    """The lines of ``shown`` (blank and ``...`` lines aside) not found, in order, in ``printed``."""
    actual = [normalise(line) for line in printed.splitlines()]
    missing, at = [], 0
    for line in shown.splitlines():
        if not line.strip() or line.strip() == "...":
            continue
        try:
            at = actual.index(normalise(line), at) + 1
        except ValueError:
            missing.append(line)
    return missing


CD_AWAY = 'cd "$(mktemp -d)"'
"""The README's step out of the checkout, into a new directory for what the minute makes."""


def first_minute() -> tuple[str, str]:
    """The section's commands and files as one bash script, in the order they come (a file is written where
    the commands before it left the shell); and the output it shows."""
    blocks = BLOCK.findall(first_section(README.read_text(encoding="utf-8")))
    kinds = [kind.split()[0] for kind, _, _ in blocks]
    shown = [body for kind, _, body in blocks if kind == "output"]
    assert "run" in kinds and "file" in kinds and len(shown) == 1, (
        f"README's first section lost its marked blocks (run, file NAME, output): {kinds}")
    script: list[str] = []
    for kind, name, body in blocks:
        if name:
            script.append(f"cat > {name} <<'FIRST_MINUTE_EOF'\n{body}FIRST_MINUTE_EOF")
        elif kind == "run":
            script.extend(body.splitlines())
    assert any(line.startswith("pip install") for line in script), "the section lost its install step"
    assert sum(line.startswith(CD_AWAY) for line in script) == 1, (
        "the section lost its step out of the checkout")
    # The install is not run: the plugin is installed in this venv already (and .ci/package proves that the
    # built wheel installs and works).
    return "\n".join(line for line in script if not line.startswith("pip install")), shown[0]


def run_first_minute(script: str, cwd: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``script`` in ``cwd``, with this venv's ``python`` and ``pytest`` on PATH as a newcomer's venv has
    them, and, as ``pip install .`` leaves it, without pytest-timeout."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, run in (("python", ""), ("pytest", " -m pytest")):
        (bindir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{run} "$@"\n')
        (bindir / name).chmod(0o755)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("GPUCLEAN_", "PYTEST_")) and name != "CUDA_VISIBLE_DEVICES"}
    if "GPUCLEAN_TEST" in os.environ:  # this session's cookie, when it runs under gpuclean (CI does)
        env["GPUCLEAN_TEST"] = os.environ["GPUCLEAN_TEST"]
    env.update(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", COLUMNS="80", TMPDIR=str(tmp_path / "tmp"),
               GPUCLEAN_LOCK_DIR=str(tmp_path / "locks"), PYTEST_ADDOPTS="-p no:timeout")
    try:
        return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=120)
    finally:
        # Had the plugin not loaded, the leaked worker would still run: it names this test's directory.
        for process in psutil.process_iter(["cmdline", "uids"]):
            if (process.info["uids"] and process.info["uids"].real == os.getuid()
                    and str(tmp_path) in " ".join(process.info["cmdline"] or ())):
                with contextlib.suppress(psutil.Error):
                    process.kill()


def assert_shown(shown: str, proc: subprocess.CompletedProcess[str]) -> None:
    missing = missing_lines(shown, proc.stdout)
    assert not missing, "README's output is not what its commands print; missing:\n" + "\n".join(
        missing) + f"\n\nprinted:\n{proc.stdout}"
    assert "warning" not in proc.stdout.lower(), proc.stdout  # none shown, none printed
    assert proc.returncode == 1, proc.stdout  # the run fails: the leak is an error


def test_the_first_minute_runs_as_written_from_the_checkout(tmp_path: Path) -> None:
    # Started in the checkout, as the README says; it steps out of it and leaves nothing there (it left
    # sim/ and test_first.py, and printed the checkout's configfile and its warning, before).
    script, shown = first_minute()
    before = sorted(p.name for p in ROOT.iterdir())
    try:
        proc = run_first_minute(script, ROOT, tmp_path)
    finally:
        made = sorted(set(p.name for p in ROOT.iterdir()) - set(before))
        for name in made:  # (only where the README's step out of the checkout is broken)
            shutil.rmtree(ROOT / name) if (ROOT / name).is_dir() else (ROOT / name).unlink()
    assert made == [], f"the first minute left {made} in the checkout"
    assert "configfile" not in proc.stdout, proc.stdout
    assert_shown(shown, proc)


def test_the_first_minute_prints_the_same_where_the_checkouts_configuration_applies(tmp_path: Path) -> None:
    # A newcomer who skips the step out of the checkout runs under the project's pytest configuration
    # (here a copy of it): the same output, and no warning about a key of a plugin `pip install .` does
    # not bring (the project's `timeout = 600` warned so in every run without pytest-timeout).
    script, shown = first_minute()
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy(ROOT / "pyproject.toml", checkout)
    proc = run_first_minute("\n".join(line for line in script.splitlines() if not line.startswith(CD_AWAY)),
                            checkout, tmp_path)
    assert "configfile: pyproject.toml" in proc.stdout, proc.stdout  # under the checkout's configuration
    assert_shown(shown, proc)


def test_each_of_the_projects_tests_has_pytest_timeouts_limit(request: pytest.FixtureRequest) -> None:
    # tests/conftest.py gives it (not pyproject.toml's `timeout`, which warned without pytest-timeout).
    if not request.config.pluginmanager.hasplugin("timeout"):
        pytest.skip("pytest-timeout is not installed here")
    if request.config.getoption("timeout", None) is not None or os.environ.get("PYTEST_TIMEOUT"):
        pytest.skip("a timeout was given for this run")
    marker = request.node.get_closest_marker("timeout")
    assert marker is not None and marker.args == (TEST_TIMEOUT_S,)


def test_the_comparison_needs_each_shown_line_in_order() -> None:
    printed = "3 checked test(s)\npid 41 ended by SIGTERM after 0.01s\n=== 3 passed, 1 error in 1.38s ==="
    assert missing_lines("...\npid 7 ended by SIGTERM after 2.50s\n\n===== 3 passed, 1 error in 9.00s =====",
                         printed) == []
    shown_out_of_order = "=== 3 passed, 1 error in 1.38s ===\n3 checked test(s)"
    assert missing_lines(shown_out_of_order, printed) == ["3 checked test(s)"]
    assert missing_lines("=== 3 passed in 1.38s ===", printed) == ["=== 3 passed in 1.38s ==="]
    assert missing_lines("pid 41 ended by SIGKILL after 0.01s", printed) != []

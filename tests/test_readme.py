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
import subprocess
import sys
from pathlib import Path

import psutil

README = Path(__file__).resolve().parent.parent / "README.md"
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


def test_the_first_minute_runs_as_written(tmp_path: Path) -> None:
    blocks = BLOCK.findall(first_section(README.read_text(encoding="utf-8")))
    runs = [body for kind, _, body in blocks if kind == "run"]
    files = [(name, body) for kind, name, body in blocks if name]
    shown = [body for kind, _, body in blocks if kind == "output"]
    assert runs and files and len(shown) == 1, (
        f"README's first section lost its marked blocks (run, file NAME, output): {[b[0] for b in blocks]}")
    commands = [line for body in runs for line in body.splitlines()]
    assert any(line.startswith("pip install") for line in commands), "the section lost its install step"
    for name, body in files:
        (tmp_path / name).write_text(body)
    # `python` and `pytest` as a newcomer's venv has them on PATH: this venv's.
    bindir = tmp_path.parent / f"{tmp_path.name}-bin"
    bindir.mkdir()
    for name, run in (("python", ""), ("pytest", " -m pytest")):
        (bindir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{run} "$@"\n')
        (bindir / name).chmod(0o755)
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("GPUCLEAN_", "PYTEST_")) and name != "CUDA_VISIBLE_DEVICES"}
    if "GPUCLEAN_TEST" in os.environ:  # this session's cookie, when it runs under gpuclean (CI does)
        env["GPUCLEAN_TEST"] = os.environ["GPUCLEAN_TEST"]
    env.update(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", COLUMNS="80",
               GPUCLEAN_LOCK_DIR=str(tmp_path.parent / f"{tmp_path.name}-locks"))
    script = "\n".join(line for line in commands if not line.startswith("pip install"))
    try:
        proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=120)
    finally:
        # Had the plugin not loaded, the leaked worker would still run: it names this test's directory.
        for process in psutil.process_iter(["cmdline", "uids"]):
            if (process.info["uids"] and process.info["uids"].real == os.getuid()
                    and str(tmp_path) in " ".join(process.info["cmdline"] or ())):
                with contextlib.suppress(psutil.Error):
                    process.kill()
    missing = missing_lines(shown[0], proc.stdout)
    assert not missing, "README's output is not what its commands print; missing:\n" + "\n".join(
        missing) + f"\n\nprinted:\n{proc.stdout}"
    assert proc.returncode == 1, proc.stdout  # the run fails: the leak is an error


def test_the_comparison_needs_each_shown_line_in_order() -> None:
    printed = "3 checked test(s)\npid 41 ended by SIGTERM after 0.01s\n=== 3 passed, 1 error in 1.38s ==="
    assert missing_lines("...\npid 7 ended by SIGTERM after 2.50s\n\n===== 3 passed, 1 error in 9.00s =====",
                         printed) == []
    shown_out_of_order = "=== 3 passed, 1 error in 1.38s ===\n3 checked test(s)"
    assert missing_lines(shown_out_of_order, printed) == ["3 checked test(s)"]
    assert missing_lines("=== 3 passed in 1.38s ===", printed) == ["=== 3 passed in 1.38s ==="]
    assert missing_lines("pid 41 ended by SIGKILL after 0.01s", printed) != []

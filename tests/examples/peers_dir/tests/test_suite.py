"""Tests of a stand-in third-party suite: names with brackets and slashes, a cache per run, (with
PEER_LEAK=1) a test that leaks a process, (PEER_SLOW) one that hangs, and (PEER_FLAKY) one that fails
now and then under gpuclean."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_passes(request: pytest.FixtureRequest) -> None:
    assert 1 + 1 == 2
    # PEER_FLAKY=PATH: under gpuclean it fails the first 2 times it runs (counted in PATH), then passes, as a
    # test that measures the whole box (its free memory) fails now and then while neighbours run.
    count = os.environ.get("PEER_FLAKY")
    if count and request.config.pluginmanager.has_plugin("gpuclean"):
        runs = int(Path(count).read_text()) if Path(count).exists() else 0
        Path(count).write_text(str(runs + 1))
        assert runs >= 2, f"run {runs + 1} under gpuclean"


@pytest.mark.parametrize("value", ["a/b", "c[d]"])
class TestNested:
    def test_param(self, value: str) -> None:
        assert value


def test_cache_is_this_runs_own() -> None:
    # run_peers.py gives each run its own caches ({tag}): the second way must not find the first's.
    cache = Path(os.environ["PEER_CACHE"])
    cache.mkdir(parents=True, exist_ok=True)
    assert not (cache / "seen").exists(), "a cache another run filled"
    (cache / "seen").write_text("seen")


def test_leaks_a_sleeper() -> None:
    if os.environ.get("PEER_LEAK") == "1":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_sleeps_when_asked(request: pytest.FixtureRequest) -> None:
    # PEER_SLOW=1: a test that hangs in every way; PEER_SLOW=gpuclean: only where gpuclean is loaded, as a
    # hang the plugin caused would.
    slow = os.environ.get("PEER_SLOW")
    if slow == "1" or (slow == "gpuclean" and request.config.pluginmanager.has_plugin("gpuclean")):
        import time

        time.sleep(120)

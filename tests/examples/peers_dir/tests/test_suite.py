"""Tests of a stand-in third-party suite: names with brackets and slashes, a cache per run, (with
PEER_LEAK=1) a test that leaks a process, and (PEER_SLOW) one that hangs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_passes() -> None:
    assert 1 + 1 == 2


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

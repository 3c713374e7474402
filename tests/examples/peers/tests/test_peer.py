"""A stand-in for a peer suite (tests/test_peers_runner.py runs it through run_peers.py as "vLLM's tests")."""

import os

import pytest


def test_passes() -> None:
    assert 1 + 1 == 2


def test_skips() -> None:
    pytest.skip("as a peer suite's test does without its optional dependency")


def test_fails_only_under_gpuclean(request: pytest.FixtureRequest) -> None:
    # With PEER_PROBE=1 it fails wherever gpuclean is loaded: an outcome that gpuclean changes, for real.
    if os.environ.get("PEER_PROBE") == "1":
        assert not request.config.pluginmanager.has_plugin("gpuclean")

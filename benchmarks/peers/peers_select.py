"""pytest plugin (``-p peers_select``): keep a stable slice of a peer suite, the same on every machine.

``PEERS_SHARD=K`` keeps the tests whose key hashes to 0 modulo K (SHA-256, so the slice depends only on
the tests' names, not on the order, the machine or the Python hash seed); ``PEERS_SHARD_PART=R`` (0 to K-1)
keeps those that hash to R instead, so K runs of parts 0..K-1 cover a suite once, for one that does not fit
one run; ``PEERS_SHARD_KEY=name``
hashes the test's name within its class (the driver's file name differs between machines),
``nodeid`` (the default) its node id relative to the rootdir. ``PEERS_SHARD`` unset or 1 keeps all.
``PEERS_KEEP_FILE=PATH`` keeps only the node ids listed in PATH (one a line): the re-run of a test whose
outcome differed between two runs. ``PEERS_LIST_FILE=PATH`` writes each kept test's JUnit key
(``classname::name``, as pytest's junitxml names it) and node id to PATH, a tab between them, one test a
line: how run_peers.py finds the node id of a test it knows from JUnit XML. ``PEERS_PROGRESS_FILE=PATH``
appends ``start<TAB>NODEID`` when a test starts and ``done<TAB>JUNIT KEY<TAB>OUTCOME`` when it has ended
(OUTCOME as run_peers.py reads JUnit XML: error if its setup or teardown failed, else failed, skipped or
passed), a line at a time: how run_peers.py tells a way that hangs from one that is slow, and which tests a
way that it had to kill finished (pytest writes its JUnit XML only at the end).
"""

from __future__ import annotations

import hashlib
import os
from typing import IO

import pytest

try:
    from _pytest.junitxml import mangle_test_address
except ImportError:  # (private: should a pytest move it, the plain form of its rule)
    def mangle_test_address(address: str) -> list[str]:
        path, bracket, params = address.partition("[")
        names = path.split("::")
        names[0] = names[0].replace("/", ".").removesuffix(".py")
        names[-1] += bracket + params
        return names


def junit_key(nodeid: str) -> str:
    """``classname::name`` of a test as pytest's JUnit XML writes it (no junit_prefix)."""
    names = mangle_test_address(nodeid)
    return f"{'.'.join(names[:-1])}::{names[-1]}"


def shard_key(item: pytest.Item, key: str) -> str:
    """What is hashed: ``Class::test_name`` (``name``) or the node id (``nodeid``)."""
    if key == "name":
        cls = getattr(item, "cls", None)
        return f"{cls.__name__}::{item.name}" if cls is not None else item.name
    return item.nodeid


def in_shard(text: str, shard: int, part: int = 0) -> bool:
    """True if ``text`` is in part ``part`` of the slices of 1 in ``shard``."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % shard == part


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = int(os.environ.get("PEERS_SHARD", "1"))
    part = int(os.environ.get("PEERS_SHARD_PART", "0"))
    if not 0 <= part < max(shard, 1):
        raise pytest.UsageError(f"PEERS_SHARD_PART={part}: not a part of PEERS_SHARD={shard} "
                                f"(0 to {shard - 1})")
    key = os.environ.get("PEERS_SHARD_KEY", "nodeid")
    keep_file = os.environ.get("PEERS_KEEP_FILE")
    wanted = None
    if keep_file:
        with open(keep_file, encoding="utf-8") as f:
            wanted = {line.strip() for line in f if line.strip()}
    selected: list[pytest.Item] = []
    deselected: list[pytest.Item] = []
    for item in items:
        keep = in_shard(shard_key(item, key), shard, part) if shard > 1 else True
        if wanted is not None:
            keep = item.nodeid in wanted
        (selected if keep else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
    listing = os.environ.get("PEERS_LIST_FILE")
    if listing:
        with open(listing, "w", encoding="utf-8") as f:
            f.writelines(f"{junit_key(item.nodeid)}\t{item.nodeid}\n" for item in selected)


RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
"""Which outcome of a test's phases wins, as in run_peers.py's reading of JUnit XML."""


class Progress:
    """``PEERS_PROGRESS_FILE``: each test's start and outcome, written as they happen."""

    def __init__(self, path: str) -> None:
        self.file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the session)
        self.outcomes: dict[str, str] = {}

    def write(self, *fields: str) -> None:
        self.file.write("\t".join(fields) + "\n")
        self.file.flush()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.outcomes[nodeid] = "passed"
        self.write("start", nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if str(report.outcome) == "rerun":  # (pytest-rerunfailures: the next attempt decides)
            self.outcomes[report.nodeid] = "passed"
            return
        outcome = ("error" if report.failed and report.when != "call" else "failed" if report.failed
                   else "skipped" if report.skipped else "passed")
        if RANK[outcome] > RANK[self.outcomes.get(report.nodeid, "passed")]:
            self.outcomes[report.nodeid] = outcome

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        self.write("done", junit_key(nodeid), self.outcomes.pop(nodeid, "passed"))

    def pytest_unconfigure(self) -> None:
        self.file.close()


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get("PEERS_PROGRESS_FILE")
    if path and not hasattr(config, "workerinput"):  # (an xdist worker's tests are its controller's)
        config.pluginmanager.register(Progress(path), "peers_progress")

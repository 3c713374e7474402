"""The Ray cluster's part of a session's checks and outputs: a plugin of gpuclean's own hooks, registered
only with ``--gpuclean-ray``. ``cluster.py`` is imported only once a cluster is named or found, hence the
function-level imports."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpuclean._model.outcomes import ALL_KINDS, split_own
from pytest_gpuclean._model.records import CheckResult, Phase, Reaped, TestRecord
from pytest_gpuclean._ownership.cookie import COOKIE_VAR, OWNER_VAR, SESSION_NAME, SESSION_TOKEN
from pytest_gpuclean._reading import procfs
from pytest_gpuclean.ray import reporting
from pytest_gpuclean.report import terminal

if TYPE_CHECKING:
    from pytest_gpuclean._check.checker import Checker
    from pytest_gpuclean._session.checked import CheckedSession
    from pytest_gpuclean._session.guard import TestState
    from pytest_gpuclean._settings import Settings


PLUGIN_NAME = "gpuclean-ray"


GCS_SERVER = "gcs_server"
"""The command name (``/proc/<pid>/comm``) of Ray's control store, the GCS server: one per cluster."""


def watches(resolved: Settings) -> bool:
    """``auto`` without ``RAY_ADDRESS``: the session looks for a cluster its own tests start."""
    return resolved.ray == "auto" and not os.environ.get("RAY_ADDRESS")


def open_cluster(resolved: Settings, checker: Checker) -> Any:
    """The started cluster check, or None when no cluster is named (yet). Raises ``pytest.UsageError`` for
    a cluster that cannot be reached."""
    if resolved.ray == "off" or watches(resolved):
        return None
    from pytest_gpuclean.ray import cluster

    address = cluster.resolve_address(resolved.ray)
    if address is None:
        return None
    check = _new_check(address, resolved, checker)
    try:
        check.start(resolved.timeout)
    except cluster.ClusterError as exc:
        source = resolved.sources.get("ray", "")
        raise pytest.UsageError(f"--gpuclean-ray: {exc} ({source})") from None
    return check


def _new_check(address: str, resolved: Settings, checker: Checker) -> Any:
    from pytest_gpuclean.ray import cluster

    # The agent is the session's own helper whenever it starts: never a test's leak.
    return cluster.ClusterChecker(address, checker.ownership, reap=resolved.reap == "on",
                                  grace=resolved.grace,
                                  agent_env={COOKIE_VAR: checker.ownership.cookie(SESSION_TOKEN),
                                             OWNER_VAR: SESSION_NAME}, older=checker.is_older)


def gcs_address(pid: int) -> str | None:
    """The address of the Ray GCS server ``pid``, None while it does not listen yet (or it is gone).

    From its ``--node-ip-address`` and ``--gcs_server_port``; with port 0 (what ``ray.init()`` asks for)
    the server writes the bound port to ``<--session-dir>/gcs_server_port_<--node-id>`` once it listens.
    """
    try:
        raw = procfs.read_file(f"/proc/{pid}/cmdline")
    except OSError:
        return None
    options: dict[str, str] = {}
    for arg in raw.decode(errors="replace").split("\0")[1:]:
        key, sep, value = arg.partition("=")
        if sep and key.startswith("--"):
            options[key[2:].replace("-", "_")] = value
    ip, port = options.get("node_ip_address", ""), options.get("gcs_server_port", "0")
    if port == "0" and options.get("session_dir") and options.get("node_id"):
        try:
            with open(os.path.join(options["session_dir"], f"gcs_server_port_{options['node_id']}")) as f:
                port = f.read().strip()
        except OSError:
            return None  # not listening yet: the next check looks again
    if not ip or not port.isdigit() or port == "0":
        return None
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _command_name(pid: int) -> str:
    try:
        return procfs.read_file(f"/proc/{pid}/comm", whole=True).decode(errors="replace").rstrip("\n")
    except OSError:
        return ""


class RayHooks:
    """Checks the cluster around each checked test, and sweeps it at the end.

    With ``watch`` (``auto`` without ``RAY_ADDRESS``), each local census is searched for a Ray GCS server
    of the session's; once one listens its cluster is checked like a named one, until that server exits.
    """

    def __init__(self) -> None:
        self.ray: Any = None
        self.session: CheckedSession | None = None
        self.watch = False
        self.gcs: tuple[int, int] | None = None
        """The discovered cluster's GCS server (pid, start ticks), while its cluster is checked."""
        self._looked: dict[tuple[int, int], bool] = {}
        """(pid, start ticks) -> whether that session process is a GCS server."""
        self._refused: set[tuple[int, int]] = set()
        """GCS servers whose cluster could not be used: not tried again."""
        self.address = ""
        self.version = ""
        """The (last) cluster checked and its Ray version ('' for none: ``auto`` found none)."""
        self.sweeps: list[CheckResult] = []
        """Session-end sweeps."""

    # ---- gpuclean's hooks (hookspecs.py) --------------------------------------------------------------

    def pytest_gpuclean_session_start(self, session: CheckedSession) -> None:
        self.session = session
        self.ray = open_cluster(session.settings, session.checker)
        self.watch = self.ray is None and watches(session.settings)
        if self.ray is not None:
            self._connected(self.ray.address, self.ray.version)

    def pytest_gpuclean_check_before(self, state: TestState, record: TestRecord) -> str | None:
        return self.before(state, record)

    def pytest_gpuclean_check_after(self, state: TestState, record: TestRecord) -> str | None:
        return self.after(state, record)

    def pytest_gpuclean_checked(self, state: TestState, record: TestRecord, phase: Phase) -> str | None:
        if not self.discover("before" if phase == "setup" else "after", state.nodeid):
            return None
        if phase == "setup":
            return self.before(state, record)
        # Started during the test: checked from now on, this test's own leftovers there included.
        return self.after(state, record, appeared=True)

    def pytest_gpuclean_sweep(self, include_session: bool, timeout: float) -> list[Reaped]:
        return self.sweep(include_session=include_session, timeout=timeout)

    def pytest_gpuclean_session_finish(self) -> None:
        self.stop()

    def pytest_gpuclean_summary_parts(self, record: TestRecord) -> list[str]:
        return reporting.summary_parts(record)

    def pytest_gpuclean_report_test(self, record: TestRecord) -> reporting.JsonDict:
        return reporting.record_keys(record)

    def pytest_gpuclean_report_session(self) -> reporting.JsonDict:
        # Only once a cluster was checked: a report without one keeps its shape.
        if not self.address:
            return {}  # auto found no cluster
        return {"ray": reporting.ray_json(self.address, self.version, self.sweeps)}

    @property
    def _session(self) -> CheckedSession:
        assert self.session is not None  # every hook but the first comes after the session started
        return self.session

    def _connected(self, address: str, version: str) -> None:
        self.address, self.version = address, version  # the last cluster checked, for the JSON report

    # ---- a cluster the session started (``auto``) ---------------------------------------------------

    def discover(self, phase: str, nodeid: str) -> bool:
        """Watching: whether the local check's census shows a session GCS server that now listens; if so,
        its cluster is checked from now on."""
        if not self.watch or self.ray is not None:
            return False
        looked: dict[tuple[int, int], bool] = {}
        found = None
        for f in self._session.checker.last_census:
            if f.debris_of is not None or not f.live:
                continue
            is_gcs = self._looked.get(f.key)
            if is_gcs is None:
                is_gcs = _command_name(f.pid) == GCS_SERVER
            looked[f.key] = is_gcs
            if is_gcs and found is None and f.key not in self._refused:
                found = f
        self._looked = looked
        if found is None:
            return False
        address = gcs_address(found.pid)
        if address is None:
            return False
        from pytest_gpuclean.ray import cluster

        resolved = self._session.settings
        check = _new_check(address, resolved, self._session.checker)
        try:
            check.start(resolved.timeout)
        except cluster.ClusterError as exc:
            self._refused.add(found.key)
            self._session.records.note(
                f"gpuclean: --gpuclean-ray=auto: found the Ray cluster at {address} that this session "
                f"started (GCS server pid {found.pid}) at the check {phase} {nodeid}, but cannot check it: "
                f"{exc}")
            return False
        self.ray, self.gcs = check, found.key
        self._connected(address, check.version)
        self._session.records.note(
            f"gpuclean: --gpuclean-ray=auto: checking the Ray cluster at {address} (GCS server pid "
            f"{found.pid}, started by this session) from the check {phase} {nodeid} on")
        return True

    def _active(self) -> bool:
        """Whether there is a cluster to check; a discovered one whose GCS server exited is let go."""
        if self.ray is None:
            return False
        if self.gcs is not None and not procfs.is_live(*self.gcs):
            self._let_go()
            return False
        return True

    def _gone(self) -> bool:
        """After a check that could not reach the cluster: whether the session's own cluster shut down
        meanwhile (no finding: the session watches again)."""
        if self.gcs is None or not self.ray.unreachable or procfs.is_live(*self.gcs):
            return False
        self._let_go()
        return True

    def _let_go(self) -> None:
        self._session.records.note(f"gpuclean: --gpuclean-ray=auto: the Ray cluster at {self.ray.address} "
                                   "shut down (its GCS server exited); watching for another")
        self.ray.stop()
        self.ray = None
        self.gcs = None

    # ---- the checks ---------------------------------------------------------------------------------

    def before(self, state: TestState, record: TestRecord) -> str | None:
        """Check the cluster before the test; the failure (it is not clean), if any."""
        if not self._active():
            return None
        result = self.ray.check_cluster("setup", tolerance_mib=state.tolerance_mib, timeout=state.timeout)
        if self._gone():
            return None
        record.cluster_before = result
        self._session.attribute_earlier(result.reaped, state.nodeid, result.notes)
        if not result.clean:
            return reporting.check_report(result, "gpuclean: the Ray cluster is not clean before the test")
        return None

    def after(self, state: TestState, record: TestRecord, *, appeared: bool = False) -> str | None:
        """Check the cluster after the test; the failure to report, if any.

        ``appeared``: found only now, so no check before saw it: the test answers for what of its own it
        left there, not for the nodes' devices.
        """
        if not self._active():
            return None
        result = self.ray.check_cluster("teardown", tolerance_mib=state.tolerance_mib, timeout=state.timeout)
        if self._gone():
            return None
        session = self._session
        own_tokens = {state.token, *state.fixture_tokens}
        # Every kind of owner is judged: only what carries this test's (or its fixtures') token is its own.
        own, earlier = split_own(result.reaped, lambda owner: session.token_of(owner) in own_tokens,
                                 ALL_KINDS)
        session.attribute_earlier(earlier, state.nodeid, result.notes)
        result = result._replace(reaped=tuple(own))
        record.cluster_after = result
        leaked = [o for o in result.offenders if o.reason == "leaked"]
        if own or leaked:
            return reporting.check_report(result, terminal.leak_heading(own, leaked, self.ray.reap)
                                          + " on the Ray cluster")
        if not result.clean and not appeared:
            return reporting.check_report(result, "gpuclean: the Ray cluster is not clean after the test")
        return None

    def sweep(self, *, include_session: bool, timeout: float) -> list[Reaped]:
        """The cluster's part of the final sweep: what the session left on the cluster, reaped."""
        records = self._session.records
        if not self._active():
            return []
        try:
            check = self.ray.sweep(include_session=include_session, timeout=timeout)
        except Exception as exc:  # the session is over: say what went wrong, lose nothing else
            records.note(f"session end: the sweep of the Ray cluster failed: {exc!r}")
            sys.stderr.write(f"gpuclean: the sweep of the Ray cluster failed: {exc!r}\n")
            return []
        if self._gone():
            return []
        self.sweeps.append(check)
        reaped = list(check.reaped)
        if include_session and (reaped or not check.clean):
            # After the reports: say it where the user looks.
            sys.stderr.write("gpuclean: the Ray cluster at the very end: " + "; ".join(
                [f"reaped pid {r.process.pid} {'by ray.kill' if r.via == 'ray.kill' else r.how_ended} "
                 f"({terminal.one_line(r.process.cmdline, 80)})" for r in reaped]
                + [terminal.one_line(o.detail or str(o.process), 120) for o in check.offenders]) + "\n")
        return reaped

    def stop(self) -> None:
        """The last sweep (the session set-up's leftovers too), then the cluster's agent stops."""
        if self.session is None:
            return  # the session never started: nothing was opened
        self.sweep(include_session=True, timeout=self.session.settings.timeout)
        if self.ray is not None:
            self.ray.stop()

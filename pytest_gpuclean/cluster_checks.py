"""The Ray cluster's part of a session's checks (``--gpuclean-ray``): before and after each test, and the
cluster's sweep at the session's end.

``cluster.py`` (and Ray, which it drives) is imported only when the option names a cluster.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpuclean import report

if TYPE_CHECKING:
    from pytest_gpuclean.checker import Checker
    from pytest_gpuclean.findings import Reaped
    from pytest_gpuclean.model import TestRecord
    from pytest_gpuclean.session import CheckedSession
    from pytest_gpuclean.settings import Settings
    from pytest_gpuclean.testcheck import ItemState


def open_cluster(resolved: Settings, checker: Checker) -> Any:
    """The cluster's check (``cluster.RayCheck``, started), or None when the option names no cluster.
    Raises ``pytest.UsageError`` for a cluster that cannot be reached."""
    if resolved.ray == "off":
        return None
    from pytest_gpuclean import cluster

    address = cluster.resolve_address(resolved.ray)
    if address is None:
        return None
    check = cluster.RayCheck(address, checker.ownership, reap=resolved.reap == "on", grace=resolved.grace)
    try:
        check.start(resolved.timeout)
    except cluster.ClusterError as exc:
        source = resolved.sources.get("ray", "")
        raise pytest.UsageError(f"--gpuclean-ray: {exc} ({source})") from None
    return check


class ClusterChecks:
    """Checks the cluster around each checked test, and sweeps it at the end (``ray``: a ``RayCheck``)."""

    def __init__(self, ray: Any, session: CheckedSession) -> None:
        self.ray = ray
        self.session = session

    def before(self, state: ItemState, record: TestRecord) -> None:
        """Check the cluster before the test; fails the setup if it is not clean."""
        check = self.ray.check_cluster("setup", tolerance_mib=state.tolerance_mib, timeout=state.timeout)
        record.cluster_before = check
        result = self.ray.result(check)
        self.session.attribute_earlier(result.reaped, state.nodeid, result.notes)
        if not result.clean:
            pytest.fail(report.check_report(result, "gpuclean: the Ray cluster is not clean before the test"),
                        pytrace=False)

    def after(self, state: ItemState, record: TestRecord) -> str | None:
        """Check the cluster after the test; the failure to report, if any."""
        check = self.ray.check_cluster("teardown", tolerance_mib=state.tolerance_mib, timeout=state.timeout)
        result = self.ray.result(check)
        own_tokens = {state.token, *state.fixture_tokens}
        own = [r for r in result.reaped if r.owner is None or self.session.token_of(r.owner) in own_tokens]
        self.session.attribute_earlier([r for r in result.reaped if r not in own], state.nodeid, result.notes)
        result = dataclasses.replace(result, reaped=tuple(own))
        record.cluster_after = dataclasses.replace(check, reaped=tuple(r for r in check.reaped
                                                                       if r.reaped in own))
        leaked = [o for o in result.offenders if o.reason == "leaked"]
        if own or leaked:
            return report.check_report(result, report.leak_heading(own, leaked, self.ray.reap)
                                       + " on the Ray cluster")
        if not result.clean:
            return report.check_report(result, "gpuclean: the Ray cluster is not clean after the test")
        return None

    def sweep(self, *, include_session: bool, timeout: float) -> list[Reaped]:
        """The cluster's part of the final sweep: what the session left on the cluster, reaped."""
        found = self.session.found
        try:
            check = self.ray.sweep(include_session=include_session, timeout=timeout)
        except Exception as exc:  # the session is over: say what went wrong, lose nothing else
            found.note(f"session end: the sweep of the Ray cluster failed: {exc!r}")
            sys.stderr.write(f"gpuclean: the sweep of the Ray cluster failed: {exc!r}\n")
            return []
        found.cluster_sweeps.append(check)
        reaped = [r.reaped for r in check.reaped]
        if include_session and (reaped or not check.clean):
            # After the reports: say it where the user looks.
            sys.stderr.write("gpuclean: the Ray cluster at the very end: " + "; ".join(
                [f"reaped pid {r.reaped.process.pid} "
                 f"{'by ray.kill' if r.via == 'ray.kill' else r.reaped.how_ended} "
                 f"({report.one_line(r.reaped.process.cmdline, 80)})" for r in check.reaped]
                + [report.one_line(f.offender.detail or str(f.offender.process), 120)
                   for f in check.findings]) + "\n")
        return reaped

    def stop(self) -> None:
        """The last sweep (the session set-up's leftovers too), then the cluster's agent stops."""
        self.sweep(include_session=True, timeout=self.session.settings.timeout)
        self.ray.stop()

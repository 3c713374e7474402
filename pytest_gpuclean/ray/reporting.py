"""The Ray cluster's own part of what gpuclean reports (text, summary parts, JSON keys): its nodes, how each
let go, what Ray ended itself. Its findings are already in the ordinary records."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pytest_gpuclean._model.records import CheckResult, DeviceSnapshot, Reaped, TestRecord
from pytest_gpuclean.report import jsonreport, terminal

JsonDict = dict[str, Any]


# ---- text -----------------------------------------------------------------------------------------------


def check_report(result: CheckResult, heading: str) -> str:
    """The long text of a cluster's failed or leaking check: its nodes' devices, how they let go, what Ray
    ended."""
    return terminal.check_report(result, heading, more_notes=cluster_notes(result),
                               devices=cluster_devices(result))


def cluster_devices(result: CheckResult) -> tuple[DeviceSnapshot, ...]:
    """Every alive node's devices, as the check read them."""
    return () if result.cluster is None else tuple(s for n in result.cluster.nodes for s in n.devices)


def cluster_notes(result: CheckResult) -> list[str]:
    """A Ray cluster's check: how long each node's devices took to let go, and what Ray ended itself."""
    if result.cluster is None:
        return []
    notes = [f"node {r.node_id[:8]}: devices released in {r.release_s:.2f}s" if r.release_s is not None
             else f"node {r.node_id[:8]}: devices still list pid(s) {', '.join(map(str, r.pids))} at the "
             "deadline" for r in result.cluster.releases if r.pids]
    via = [f"pid {r.process.pid} by ray.kill" for r in result.reaped if r.via == "ray.kill"]
    if via:
        notes.append("ended through Ray: " + ", ".join(via))
    return notes


def summary_parts(record: TestRecord) -> list[str]:
    """Per node: what was ended and how, what is still there, and how long its devices took to let go."""
    parts: list[str] = []
    for check in (record.cluster_before, record.cluster_after):
        if check is None or (check.clean and not check.reaped):
            continue
        nodes = sorted({r.node or "" for r in check.reaped} | {o.node or "" for o in check.offenders})
        releases = check.cluster.releases if check.cluster is not None else ()
        for node in nodes:
            where = f"node {node[:8]}" if node else "the cluster"
            ended = [r for r in check.reaped if (r.node or "") == node]
            bits = []
            if ended:
                bits.append("reaped " + ", ".join(
                    f"pid {r.process.pid} " + ("by ray.kill" if r.via == "ray.kill" else r.how_ended)
                    for r in ended))
            release = next((x for x in releases if x.node_id == node and x.pids), None)
            if release is not None:
                bits.append(f"devices released in {release.release_s:.2f}s" if release.release_s is not None
                            else "devices did NOT let go")
            left = [o for o in check.offenders if (o.node or "") == node]
            if left:
                bits.append("not clean (" + ", ".join(terminal.short(o) for o in left) + ")")
            parts.append(f"Ray {check.phase} on {where}: " + ", ".join(bits))
    return parts


# ---- the JSON report ------------------------------------------------------------------------------------


def cluster_reaped_json(reaped: Reaped) -> JsonDict:
    """Something the cluster check ended on a Ray node: the reaped shape plus node, actor, job and how."""
    return {**jsonreport.reaped_json(reaped), "node_id": reaped.node or "", "via": reaped.via or "ladder",
            "actor_id": reaped.actor_id, "job_id": reaped.job_id}


def cluster_check_json(check: CheckResult, phase: str | None = None) -> JsonDict:
    """One check of a Ray cluster; ``phase`` is ``session end`` for the session's sweeps."""
    cluster = check.cluster
    seconds = jsonreport.seconds
    return {"address": cluster.address if cluster is not None else "", "phase": phase or check.phase,
            "clean": check.clean, "waited_s": seconds(check.waited_s),
            "nodes": [{"node_id": n.node_id, "error": n.error,
                       "devices": [jsonreport.snapshot_json(s) for s in n.devices]}
                      for n in (cluster.nodes if cluster is not None else ())],
            "findings": [{**jsonreport.offender_json(o), "node_id": o.node or ""} for o in check.offenders],
            "reaped": [cluster_reaped_json(r) for r in check.reaped],
            "releases": [{"node_id": r.node_id, "release_s": seconds(r.release_s), "pids": list(r.pids)}
                         for r in (cluster.releases if cluster is not None else ())],
            "notes": list(check.notes)}


def record_keys(record: TestRecord) -> JsonDict:
    """A test's ``cluster_before`` and ``cluster_after``; none without a cluster, so such a report keeps its
    shape."""
    before, after = record.cluster_before, record.cluster_after
    if before is None and after is None:
        return {}
    return {"cluster_before": None if before is None else cluster_check_json(before),
            "cluster_after": None if after is None else cluster_check_json(after)}


def ray_json(address: str, version: str, sweeps: Sequence[CheckResult]) -> JsonDict:
    """The session's Ray cluster (``--gpuclean-ray``) and its session-end sweeps."""
    return {"address": address, "ray_version": version,
            "session_end": [cluster_check_json(c, "session end") for c in sweeps]}

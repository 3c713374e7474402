"""``gpuclean status|check|reap --ray ADDRESS``: the commands across every alive node of a Ray cluster,
read as the plugin reads it (``cluster.ClusterChecker``). ``reap --ray`` ends less than the local ``reap``:
on each node, this user's GPU processes whose Ray job is over or that belong to none; never a running job's,
Ray's own or another user's. Named actors end through ``ray.kill``, the rest through the ladder on their
node."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, TextIO

from pytest_gpuclean import _settings as settings
from pytest_gpuclean._check import reap_plan
from pytest_gpuclean._model.records import (
    MIB,
    CheckResult,
    ClusterReading,
    NodeReading,
    Offender,
    ProcessInfo,
)
from pytest_gpuclean._ownership.evidence import Ownership
from pytest_gpuclean._version import __version__
from pytest_gpuclean.ray import cluster
from pytest_gpuclean.ray.messages import ActorRecord, Census, NamedActor, NodeProcess, NodeReport
from pytest_gpuclean.report import jsonreport, terminal


class RayCliError(Exception):
    """The cluster cannot be used: the message names ``--ray`` and where the value came from."""


def connect(address: str, resolved: settings.Settings) -> cluster.ClusterChecker:
    """A started agent for ``address``; ``RayCliError`` if it cannot connect within ``--timeout``."""
    check = cluster.ClusterChecker(address, Ownership("gpuclean-cli"), reap=False, grace=resolved.grace)
    try:
        check.start(resolved.timeout)
    except cluster.ClusterError as exc:
        raise RayCliError(f"--ray: {exc} ({resolved.sources.get('ray', 'from the command line')})") from None
    return check


def _census(agent: cluster.ClusterChecker, resolved: settings.Settings) -> Census:
    try:
        return agent.census(resolved.timeout)
    except cluster.ClusterError as exc:
        raise RayCliError(f"--ray: {exc} ({resolved.sources.get('ray', 'from the command line')})") from None


def _header(agent: cluster.ClusterChecker, census: Census) -> str:
    return f"Ray cluster at {agent.address} (Ray {agent.version}), {len(census.nodes)} alive node(s)"


def _described(node: NodeReport) -> dict[int, ProcessInfo | None]:
    known = {p.info.pid: p.info for p in node.processes}
    return {gp.pid: known.get(gp.pid) for s in node.devices for gp in s.processes}


def _node_line(node: NodeReport) -> str:
    error = f"; {node.error}" if node.error else ""
    return f"node {node.node_id}: {len(node.devices)} device(s){error}"


def status_json(agent: cluster.ClusterChecker, census: Census) -> dict[str, Any]:
    """``status --ray --json``: each alive node with its devices (named with the node) and processes."""
    return {"gpuclean_version": __version__, "ray": {"address": agent.address, "version": agent.version},
            "nodes": [{"node_id": n.node_id, "error": n.error,
                       "devices": [jsonreport.snapshot_json(s, _described(n)) for s in n.devices]}
                      for n in census.nodes],
            "dead_nodes": [{"node_id": node, "reason": why} for node, why in census.dead_nodes]}


def cmd_status(args: argparse.Namespace, out: TextIO, resolved: settings.Settings, address: str,
               status_lines: Any, print_json: Any) -> int:
    agent = connect(address, resolved)
    try:
        census = _census(agent, resolved)
    finally:
        agent.stop()
    if args.json:
        print_json(status_json(agent, census), out)
        return 0
    print(f"gpuclean status: {_header(agent, census)}", file=out)
    for node in census.nodes:
        print(_node_line(node), file=out)
        for line in status_lines(node.devices, _described(node)):
            print(f"  {line}", file=out)
    return 0


# ---- check -------------------------------------------------------------------------------------------

def as_check(address: str, census: Census, findings: Sequence[Offender], tolerance_mib: int,
             waited: float) -> CheckResult:
    """``check --ray``'s verdict: a cluster's check like the plugin's, its findings naming their node."""
    nodes = tuple(NodeReading(n.node_id, n.devices, n.error) for n in census.nodes)
    return CheckResult("check", not findings, (), tuple(findings), (), waited,
                       waited if not findings else None, (), tolerance_mib,
                       cluster=ClusterReading(address, nodes))


def cmd_check(args: argparse.Namespace, out: TextIO, resolved: settings.Settings, address: str,
              check_lines: Any, print_json: Any) -> int:
    agent = connect(address, resolved)
    started = time.monotonic()
    try:
        while True:
            census = _census(agent, resolved)
            # Any process on a node's device (whatever it holds), memory no process accounts for beyond
            # the tolerance, an unreadable or dead node.
            findings = cluster.node_findings(census, resolved.tolerance_mib, set(), resolved.ignore)
            waited = time.monotonic() - started
            if not findings or waited >= args.wait:
                break
            time.sleep(min(0.5, max(0.0, args.wait - waited)))
    finally:
        agent.stop()
    result = as_check(agent.address, census, findings, resolved.tolerance_mib, waited)
    if args.json:
        print_json({**status_json(agent, census), "clean": result.clean,
                    "tolerance_mib": result.tolerance_mib, "waited_s": round(waited, 6),
                    "offenders": [{**jsonreport.offender_json(o), "node_id": o.node or ""}
                                  for o in findings], "notes": []}, out)
    else:
        lines = check_lines(result, args.wait, os.getuid())
        print(f"{lines[0]} [{_header(agent, census)}]", file=out)
        for line in lines[1:]:
            print(line, file=out)
    return 0 if result.clean else 1


# ---- reap --------------------------------------------------------------------------------------------

class _Target(NamedTuple):
    """A process ``reap --ray`` ends: on ``node``, an actor's worker or not, holding ``mib``."""

    node: NodeReport
    process: NodeProcess
    actor: ActorRecord | None
    mib: tuple[tuple[str, float], ...]


def _is_daemon(cmdline: str) -> bool:
    return any(d in cmdline.split(" ", 1)[0] or cmdline.startswith(d) for d in cluster.RAY_DAEMONS)


def plan(census: Census, my_uid: int) -> tuple[list[_Target], list[str]]:
    """What ``reap --ray`` may end on each node, and a line for each GPU process it leaves alone (and why):
    the facts of each process on a node's devices, decided by ``reap_plan.plan``."""
    jobs = {j.job_id: j for j in census.jobs}
    actors = {(a.node_id, a.pid): a for a in census.actors if a.state == "ALIVE"}
    found: dict[tuple[str, int], _Target] = {}
    candidates: list[reap_plan.ReapCandidate] = []
    for node in census.nodes:
        known = {p.info.pid: p for p in node.processes}
        where = f"node {node.node_id[:8]}"
        for pid in sorted({gp.pid for s in node.devices for gp in s.processes}):
            mib = tuple((s.device.label, s.bytes_of({pid}) / MIB) for s in node.devices
                        if any(gp.pid == pid for gp in s.processes))
            p = known.get(pid)
            if p is None:
                candidates.append(reap_plan.ReapCandidate(pid, None, mib, where=where))
                continue
            actor = actors.get((node.node_id, pid))
            job = jobs.get(p.job_id)
            found[where, pid] = _Target(node, p, actor, mib)
            candidates.append(reap_plan.ReapCandidate(
                pid, p.info, mib, where=where,
                ray_own=pid == node.raylet_pid or (_is_daemon(p.info.cmdline) and actor is None),
                job_id=p.job_id, job_running=bool(p.job_id) and (job is None or not job.dead),
                job_driver_pid=None if job is None else job.driver_pid,
                task_worker=p.ray_worker and actor is None))
    targets, left = reap_plan.plan(candidates, my_uid=my_uid, cmd_width=80)
    return [found[t.where, t.pid] for t in targets], left


def cmd_reap(args: argparse.Namespace, out: TextIO, resolved: settings.Settings, address: str) -> int:
    agent = connect(address, resolved)
    try:
        census = _census(agent, resolved)
        targets, left = plan(census, os.getuid())
        print(f"gpuclean reap: {_header(agent, census)}", file=out)
        for line in left:
            print(f"  left alone: {line}", file=out)
        if not targets:
            print("gpuclean reap: nothing to end", file=out)
            return 0
        if args.dry_run:
            listed = []
            for t in targets:
                by = "ray.kill" if t.actor is not None and t.actor.name else "the signal ladder"
                listed.append(terminal.DryRunTarget(f"node {t.node.node_id[:8]}: ", t.process.info,
                                           f"job {t.process.job_id or '-'}, by {by}", t.mib))
            for line in terminal.dry_run_lines("gpuclean", listed):
                print(line, file=out)
            return 0
        survived = _end(agent, targets, resolved, out)
    finally:
        agent.stop()
    return 1 if survived else 0


def _end(agent: cluster.ClusterChecker, targets: list[_Target], resolved: settings.Settings,
         out: TextIO) -> bool:
    by_node: dict[str, list[_Target]] = {}
    for t in targets:
        by_node.setdefault(t.node.node_id, []).append(t)
    survived = False
    for node_id, node_targets in by_node.items():
        raylet = node_targets[0].node.raylet_pid
        actors = [NamedActor(t.actor.name, t.actor.namespace, t.actor.actor_id, t.actor.pid,
                             t.process.info.start_ticks)
                  for t in node_targets if t.actor is not None and t.actor.name]
        kills = [(t.process.info.pid, t.process.info.start_ticks, t.process.job_id) for t in node_targets]
        try:
            end = agent.end(node_id, raylet, actors, kills, resolved.grace, min(resolved.timeout, 30.0),
                            resolved.timeout)
        except cluster.ClusterError as exc:
            raise RayCliError(f"--ray: node {node_id[:8]}: {exc}") from None
        print(f"gpuclean reap: node {node_id}: ended {len(node_targets)} process(es):", file=out)
        outcomes = {o[0]: o for o in end.outcomes}
        for t in node_targets:
            outcome = outcomes.get(t.process.info.pid, (t.process.info.pid, "ladder", "survived", None,
                                                        "no answer"))
            item = cluster.node_reaped(t.process.info, None, outcome, t.mib, end, node_id)
            survived = survived or item.ended_by == "survived"
            lines = terminal.reaped_lines(item)
            lines[0] += f" [via {outcome[1]}]"
            for line in lines:
                print(line, file=out)
        for error in end.errors:
            print(f"  {error}", file=out)
        if end.held:
            print(f"gpuclean reap: node {node_id[:8]}: " + (
                f"its devices released the memory {end.release_s:.2f}s after the first kill"
                if end.release_s is not None else "its devices still list pid(s) "
                + ", ".join(map(str, end.held))), file=out)
    return survived


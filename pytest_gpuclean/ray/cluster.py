"""The check across a Ray cluster, the pytest process's side. The pytest process never imports Ray: the
agent (``agent.py``) reads the cluster; ``ClusterChecker`` decides what is a test's leak and has the agent
end it. Every request has a deadline: an unreachable cluster never hangs a test.

A Ray actor is a test's when its job's driver is this pytest process and it started in the test's window;
a process on a node is, through its actor's worker, or when it carries the job's id and was born in the
window. Ray's daemons, idle workers, other jobs' actors and other users' processes are never signalled."""

from __future__ import annotations

import fnmatch
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, cast, get_args

from pytest_gpuclean import _settings as settings
from pytest_gpuclean._model.records import (
    MIB,
    CheckResult,
    ClusterReading,
    EndedBy,
    NodeReading,
    NodeRelease,
    Offender,
    Owner,
    Phase,
    ProcessInfo,
    Reaped,
)
from pytest_gpuclean._ownership.evidence import SESSION, Ownership
from pytest_gpuclean._reading import procfs
from pytest_gpuclean.ray.messages import ActorRecord, Census, NamedActor, NodeEnd, NodeProcess, Outcome

OFF = "off"
AUTO = "auto"
# Without these, ray.init to a dead address retries for many minutes before it gives up.
CONNECT_ENV = {
    "RAY_gcs_server_port_wait_time_s": "1",
    "RAY_py_gcs_connect_timeout_s": "2",
    "RAY_gcs_rpc_server_connect_timeout_s": "1",
    # A GCS that goes away would hold each of the agent's requests for a minute (Ray's default).
    "RAY_gcs_rpc_server_reconnect_timeout_s": "3",
}
RAY_DAEMONS = ("raylet", "gcs_server", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::IDLE",
               "dashboard.py", "log_monitor.py", "monitor.py", "runtime_env/agent")


# Not ``-m``: what the agent pickles (its answers, the functions Ray ships to the nodes) must name their
# modules, not ``__main__``.
AGENT_COMMAND = ("import sys; from pytest_gpuclean.ray.agent import main; "
                 "sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))")


class ClusterError(Exception):
    """The cluster cannot be reached or used (wrong address, Ray missing, another Ray version)."""


@dataclass(slots=True)
class _Leak:
    """Something of ours alive on the cluster and not protected, owned by ``token``'s window."""

    process: NodeProcess | None
    actor: ActorRecord | None
    node: str
    token: str


def _never_older(pid: int, start_ticks: int) -> bool:
    return False


class ClusterChecker:
    """Drives the agent from the pytest process: census, attribution, reaping, the verdict."""

    def __init__(self, address: str, ownership: Ownership, reap: bool = True,
                 grace: float = settings.DEFAULT_GRACE_S, agent_env: dict[str, str] | None = None,
                 older: Callable[[int, int], bool] = _never_older) -> None:
        self.address = address
        self.ownership = ownership
        self.reap = reap
        self.grace = grace
        self.agent_env = dict(agent_env or {})
        """The session's cookie, for the agent's environment: it is the session's helper."""
        self.older = older
        """Whether a descendant (pid, start ticks) existed before the session: its jobs, and those of what
        it starts, are not the session's."""
        self.version = ""
        self.since = _process_start(os.getpid())
        """Jobs of this pid started before then had another driver of the same pid."""
        self.unreachable = ""
        """Why the last check could not reach the cluster ('' when it could)."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._inbox: Connection | None = None
        self._outbox: Connection | None = None
        self._tree = procfs.DescendantWalk()
        """This process's descendants, walked at a cost independent of its thread count."""

    def start(self, timeout: float) -> None:
        """Start the agent and connect it; ``ClusterError`` if that fails or takes over ``timeout``."""
        to_agent_r, to_agent_w = os.pipe()
        from_agent_r, from_agent_w = os.pipe()
        env = dict(os.environ, **CONNECT_ENV, **self.agent_env)
        if self.address.split(":")[0] in ("127.0.0.1", "localhost"):
            env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # else loopback is rewritten to the host IP
        self._proc = subprocess.Popen(
            [sys.executable, "-c", AGENT_COMMAND, self.address, str(to_agent_r), str(from_agent_w)],
            pass_fds=(to_agent_r, from_agent_w), env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_agent_r)
        os.close(from_agent_w)
        self._outbox = Connection(to_agent_w, readable=False)
        self._inbox = Connection(from_agent_r, writable=False)
        kind, value = self._receive(timeout, "connect")
        if kind != "ready":
            self.stop()
            raise ClusterError(f"cannot use the Ray cluster at {self.address}: {value}")
        self.version = str(value)

    def _receive(self, timeout: float, what: str) -> tuple[str, Any]:
        assert self._inbox is not None
        try:
            if not self._inbox.poll(timeout):
                self.stop()
                raise ClusterError(f"the Ray cluster at {self.address} did not answer ({what}) within "
                                   f"{timeout:.0f}s")
            reply: tuple[str, Any] = self._inbox.recv()
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            self.stop()
            why = ("exited: the cluster shut down, or its GCS stopped answering"
                   if isinstance(exc, EOFError) else repr(exc))
            raise ClusterError(f"lost the Ray cluster at {self.address} ({what}): gpuclean's agent for it "
                               f"{why}") from None
        return reply

    def _call(self, op: str, *args: Any, timeout: float) -> Any:
        if self._proc is None:
            self.start(timeout)
        assert self._outbox is not None
        self._outbox.send((op, args))
        kind, value = self._receive(timeout + 1.0, op)
        if kind != "ok":
            raise ClusterError(f"Ray cluster at {self.address}: {op} failed: {value}")
        return value

    def stop(self) -> None:
        """End the agent (its driver job ends with it)."""
        for conn in (self._inbox, self._outbox):
            if conn is not None:
                conn.close()
        self._inbox = self._outbox = None
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def census(self, timeout: float) -> Census:
        """The cluster as it is now (for the CLI: no job is ours)."""
        census: Census = self._call("census", {}, timeout, timeout=timeout)
        return census

    def end(self, node: str, raylet: int, actors: Sequence[NamedActor],
            targets: Sequence[tuple[int, int, str]], grace: float, release_wait: float, timeout: float
            ) -> NodeEnd:
        """``node.end_on_node`` on ``node``, through the agent (see there)."""
        end: NodeEnd = self._call("end", node, raylet, actors, targets, grace, release_wait, timeout,
                                  timeout=timeout)
        return end

    @property
    def agent_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ---- attribution ----------------------------------------------------------------------------

    def _token_at(self, wall: float) -> str:
        """The innermost window (test or fixture) that a Ray record's start time lies in."""
        for window in reversed(self.ownership.windows):
            start = procfs.ticks_to_wall(window.start_tick)
            # A window's ticks are truncated, the control store's times are not: a window ends up to one tick
            # after its end tick, and an actor a fixture waited for often started in that last tick.
            end = procfs.ticks_to_wall(window.end_tick + 1) if window.end_tick is not None else time.time()
            if start <= wall <= end:
                return window.token
        return SESSION

    def leaks(self, census: Census, sweep: str = "") -> list[_Leak]:
        """What of ours is alive on the cluster and not protected. ``sweep`` (session end): ``"tests"``
        takes everything of the tests and fixtures, ``"all"`` the session set-up's too."""
        def protected(token: str) -> bool:
            if sweep == "all":
                return False
            if sweep == "tests":
                return token == SESSION
            return self.ownership.is_protected(token)

        ours = set(census.our_jobs)
        found: list[_Leak] = []
        actor_by_pid: dict[tuple[str, int], _Leak] = {}
        for actor in census.actors:
            if actor.state != "ALIVE" or actor.job_id not in ours:
                continue
            token = self._token_at(actor.start_wall)
            leak = _Leak(None, actor, actor.node_id, token)
            actor_by_pid[(actor.node_id, actor.pid)] = leak
            if not protected(token):
                found.append(leak)
        for node in census.nodes:
            by_pid = {p.info.pid: p for p in node.processes}
            for p in node.processes:
                # The control store decides whose worker this is (a prestarted one has no RAY_JOB_ID),
                # unless it started after the actor did.
                actor_leak = actor_by_pid.get((node.node_id, p.info.pid))
                if actor_leak is not None and actor_leak.actor is not None and \
                        p.start_wall <= actor_leak.actor.start_wall + 1.0:
                    actor_leak.process = p
                    continue
                if p.ray_worker:
                    continue  # a task worker, idle or not, is Ray's to reuse; only what it started is a leak
                # Ancestry first: a subprocess of an actor's worker is that actor's.
                owner_leak = None
                parent = by_pid.get(p.info.ppid)
                while parent is not None and owner_leak is None:
                    owner_leak = actor_by_pid.get((node.node_id, parent.info.pid))
                    parent = by_pid.get(parent.info.ppid)
                if owner_leak is None and p.job_id not in ours:
                    continue
                token = owner_leak.token if owner_leak is not None else self._token_at(p.start_wall)
                if not protected(token):
                    found.append(_Leak(p, owner_leak.actor if owner_leak else None, node.node_id, token))
        return found

    # ---- the check ------------------------------------------------------------------------------

    def _drivers(self) -> dict[int, float]:
        """This process and its live descendants, as drivers of Ray jobs: a process a test started may
        connect as a driver of its own (vLLM's engine does)."""
        drivers = {os.getpid(): self.since}
        older: set[int] = set()
        for pid, _, parent in self._tree.walk(os.getpid()):
            if pid == self.agent_pid:
                continue  # the plugin's own helper driver
            stat = procfs.read_stat(pid)
            if stat is None:
                continue
            if parent in older or self.older(pid, stat.start_ticks):
                older.add(pid)  # `driver & exec pytest`: its jobs were never the session's
                continue
            drivers[pid] = max(self.since, procfs.ticks_to_wall(stat.start_ticks) - 0.5)
        return drivers

    def check_cluster(self, phase: Phase, *, tolerance_mib: int, timeout: float, sweep: str = ""
                      ) -> CheckResult:
        """Check every alive node; reap the test's leaks (Ray first, then the ladder on the node).
        ``sweep`` (session end): only the session's leftovers matter, not the devices' state."""
        started = time.monotonic()
        notes: list[str] = []
        self.unreachable = ""
        # Once per check: a driver the reaping ends must still name its jobs for the second census.
        drivers = self._drivers()
        try:
            census: Census = self._call("census", drivers, timeout, timeout=timeout)
            leaks = self.leaks(census, sweep)
            reaped: list[Reaped] = []
            releases: list[NodeRelease] = []
            if leaks and self.reap:
                reaped, releases = self._reap(leaks, census, notes,
                                              max(1.0, timeout - (time.monotonic() - started)))
                census = self._call("census", drivers, timeout, timeout=timeout)
                leaks = self.leaks(census, sweep)
        except ClusterError as exc:
            self.unreachable = str(exc)
            return self.unreachable_result(phase, time.monotonic() - started)
        findings = [self._offender(leak, census) for leak in leaks]
        if not sweep:
            findings += self._node_findings(census, tolerance_mib)
        nodes = tuple(NodeReading(n.node_id, n.devices, n.error) for n in census.nodes)
        waited = time.monotonic() - started
        return CheckResult(phase, not findings, (), tuple(findings), tuple(reaped), waited,
                           waited if not findings else None, tuple(notes), tolerance_mib,
                           cluster=ClusterReading(self.address, nodes, tuple(releases)))

    def unreachable_result(self, phase: Phase, waited_s: float = 0.0) -> CheckResult:
        """A check that could not reach the cluster (``unreachable`` says why): not clean."""
        finding = Offender("unreachable", None, None, "gpu", detail=self.unreachable, node="")
        return CheckResult(phase, False, (), (finding,), (), waited_s, cluster=ClusterReading(self.address))

    def sweep(self, *, include_session: bool, timeout: float) -> CheckResult:
        """At session end: end what the session's tests and fixtures (and, with ``include_session``, its
        set-up) left on the cluster, only what is provably the session's."""
        if include_session and self.unreachable:
            # The sweep after the last test could not reach it: do not wait for it a second time.
            return self.unreachable_result("check")
        return self.check_cluster("check", tolerance_mib=0, timeout=timeout,
                                  sweep="all" if include_session else "tests")

    def _reap(self, leaks: list[_Leak], census: Census, notes: list[str], timeout: float
              ) -> tuple[list[Reaped], list[NodeRelease]]:
        # Named actors end through ray.kill, so Ray frees their GPU its own way; anonymous ones cannot be
        # looked up from another job, so their worker gets the ladder, which Ray sees as the actor's death.
        raylets = {n.node_id: n.raylet_pid for n in census.nodes}
        by_node: dict[str, list[_Leak]] = {}
        for lk in leaks:
            by_node.setdefault(lk.node, []).append(lk)
        results: list[Reaped] = []
        releases: list[NodeRelease] = []
        for node, node_leaks in by_node.items():
            actors = []
            targets = []
            for lk in node_leaks:
                a, p = lk.actor, lk.process
                is_worker = a is not None and p is not None and p.info.pid == a.pid
                if a is not None and a.name and (p is None or is_worker):
                    actors.append(NamedActor(a.name, a.namespace, a.actor_id, a.pid,
                                             p.info.start_ticks if p else 0))
                if p is not None:
                    targets.append((p.info.pid, p.info.start_ticks, p.job_id))
            if node not in raylets:
                notes.append(f"node {node[:8]}: not alive: nothing there can be reaped")
                continue
            try:
                end = self.end(node, raylets[node], actors, targets, self.grace, min(timeout, 30.0), timeout)
            except ClusterError as exc:
                notes.append(f"node {node[:8]}: reaping failed: {exc}")
                continue
            notes.extend(f"node {node[:8]}: {e}" for e in end.errors)
            by_pid = {o[0]: o for o in end.outcomes}
            for lk in node_leaks:
                pid = lk.process.info.pid if lk.process is not None else lk.actor.pid if lk.actor else 0
                outcome = by_pid.get(pid)
                if outcome is None:
                    continue  # an anonymous actor whose worker was not found: still a finding
                reaped = node_reaped(self._info(lk), self.ownership.owner(lk.token), outcome,
                                     self._held(lk, census), end, node)
                results.append(reaped._replace(
                    actor_id=lk.actor.actor_id if lk.actor else "",
                    job_id=lk.process.job_id if lk.process else lk.actor.job_id if lk.actor else ""))
            releases.append(NodeRelease(node, end.release_s, end.held))
        return results, releases

    def _info(self, leak: _Leak) -> ProcessInfo:
        p = leak.process
        if p is None:
            a = leak.actor
            assert a is not None
            return ProcessInfo(a.pid, 0, 0, -1, "?", f"[node {leak.node[:8]}] ray actor {a.class_name} "
                               f"{a.actor_id[:8]} (worker not found on the node)", "?")
        what = f"actor {leak.actor.class_name} {leak.actor.actor_id[:8]}, " if leak.actor else ""
        return ProcessInfo(p.info.pid, p.info.start_ticks, p.info.ppid, p.info.uid, p.info.user,
                           f"[node {leak.node[:8]}, {what}job {p.job_id}] {p.info.cmdline}", p.info.state)

    @staticmethod
    def _held(leak: _Leak, census: Census) -> tuple[tuple[str, float], ...]:
        if leak.process is None:
            return ()
        pid = leak.process.info.pid
        return tuple((f"{s.device.name.split(':')[0]} {s.device.label}", s.bytes_of({pid}) / MIB)
                     for n in census.nodes if n.node_id == leak.node for s in n.devices
                     if any(gp.pid == pid for gp in s.processes))

    def _offender(self, leak: _Leak, census: Census) -> Offender:
        return Offender("leaked", self._info(leak), self.ownership.owner(leak.token), "gpu",
                        self._held(leak, census), detail="Ray actor" if leak.actor else "", node=leak.node)

    def _node_findings(self, census: Census, tolerance_mib: int) -> list[Offender]:
        return node_findings(census, tolerance_mib, set(census.our_jobs))


def node_findings(census: Census, tolerance_mib: int, explained_jobs: set[str],
                  ignore: Sequence[str] = ()) -> list[Offender]:
    """Dead or unreadable nodes, processes on a device no known job accounts for, and memory no process
    accounts for beyond the tolerance; each names its node."""
    found: list[Offender] = []
    for node_id, why in census.dead_nodes:
        found.append(Offender(
            "unreachable", None, None, "gpu", detail=f"Ray node {node_id[:8]} died: {why}; its workers may "
            "live on as orphans that no check can reach", node=node_id))
    for node in census.nodes:
        known = {p.info.pid: p for p in node.processes}
        explained = {pid for pid, p in known.items() if p.job_id in explained_jobs}
        if node.error:
            found.append(Offender("unreachable", None, None, "gpu",
                                  detail=f"Ray node {node.node_id[:8]}: {node.error}", node=node.node_id))
        for s in node.devices:
            listed = sum(p.used_bytes or 0 for p in s.processes)
            for gp in s.processes:
                if gp.pid in explained:
                    continue  # ours: a leak was reported above, a protected one is no finding
                proc = known.get(gp.pid)
                if proc is not None and any(fnmatch.fnmatchcase(proc.info.cmdline, g) for g in ignore):
                    continue
                where = f"[node {node.node_id[:8]}]"
                info = (proc.info._replace(cmdline=f"{where} {proc.info.cmdline}")
                        if proc is not None else
                        ProcessInfo(gp.pid, 0, 0, -1, "?", f"[node {node.node_id[:8]}] pid {gp.pid} (not "
                                    "visible on its node)", "?"))
                found.append(Offender(
                    "foreign", info, None, "gpu", ((s.device.label, (gp.used_bytes or 0) / MIB),),
                    detail=f"on {s.device.name}", node=node.node_id))
            if s.used_bytes - listed > tolerance_mib * MIB:
                found.append(Offender("memory", None, None, "gpu", (
                    (s.device.label, (s.used_bytes - listed) / MIB),),
                    detail=f"{s.device.name}: memory no process accounts for", node=node.node_id))
    return found


def node_reaped(info: ProcessInfo, owner: Owner | None, outcome: Outcome,
                held: tuple[tuple[str, float], ...], end: NodeEnd, node: str) -> Reaped:
    """A node's answer for one process, as a ``Reaped`` on ``node`` (its actor and job left blank)."""
    pid, via, ended, exit_s, state = outcome
    how = ended_by(via, ended)
    return Reaped(info, owner, "gpu", how, held, exit_s, end.release_s if pid in end.held else None,
                  survived_as=state if how == "survived" else "", node=node,
                  via="ray.kill" if via == "ray.kill" else "ladder")


def ended_by(via: str, ended: str) -> EndedBy:
    """How a node's outcome reads in a ``Reaped``: anything the ladder cannot name survived."""
    if via == "ray.kill":
        return "exited by itself"
    for word in get_args(EndedBy):
        if word == ended:
            return cast(EndedBy, word)
    return "survived"


def _process_start(pid: int) -> float:
    stat = procfs.read_stat(pid)
    return procfs.ticks_to_wall(stat.start_ticks) if stat is not None else time.time()


def resolve_address(value: str) -> str | None:
    """The address ``--gpuclean-ray`` names: None for ``off``; ``auto`` is ``RAY_ADDRESS`` if set (else
    ``hooks.RayHooks.discover`` finds one the session starts)."""
    if value == OFF:
        return None
    if value == AUTO:
        return os.environ.get("RAY_ADDRESS") or None
    return value


"""The agent: gpuclean's helper driver for a Ray cluster, a process and Ray job of its own, so the pytest
process never imports Ray.

It reads the control store's tables (no dashboard needed) and runs the ``node.py`` tasks; over a pipe it
answers each ``(op, args)`` with ``("ok", value)`` or ``("error", why)``.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from pytest_gpuclean.ray.messages import ActorRecord, Census, JobRecord, NamedActor, NodeEnd, NodeReport
from pytest_gpuclean.ray.node import end_on_node, probe_node, ray_module


class _Agent:
    """The agent's side of each request: an op of ``main``'s loop is a method here."""

    def __init__(self, address: str) -> None:
        ray = self.ray = ray_module()
        strategies = importlib.import_module("ray.util.scheduling_strategies")
        self.affinity = strategies.NodeAffinitySchedulingStrategy
        self.gcs_pb2: Any = importlib.import_module("ray.core.generated.gcs_pb2")
        self.state: Any = importlib.import_module("ray._private.state")
        ray.init(address=address, namespace="gpuclean", log_to_driver=False, logging_level="ERROR",
                 configure_logging=False)
        self.probe = ray.remote(num_cpus=0, max_retries=0)(probe_node)
        self.ender = ray.remote(num_cpus=0, max_retries=0)(end_on_node)
        self.known_alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        self.version = ray.__version__
        # This host as the control store names drivers' hosts: the address of this agent's own job.
        self.job_id = str(ray.get_runtime_context().get_job_id())

    def census(self, drivers: dict[int, float], timeout: float) -> Census:
        """``drivers``: pids on this host whose jobs are ours, each with the earliest start such a job may
        have (an older job was an earlier process's of that pid)."""
        ray = self.ray
        started = time.monotonic()
        accessor = self.state.state._connect_and_get_accessor()
        jobs = []
        all_jobs: list[JobRecord] = []
        gcs_pb2 = self.gcs_pb2
        table = [gcs_pb2.JobTableData.FromString(raw) for raw in accessor.get_job_table(
            skip_submission_job_info_field=True, skip_is_running_tasks_field=True)]
        here = next((j.driver_ip_address for j in table if j.job_id.hex() == self.job_id), None)
        for job in table:
            all_jobs.append(JobRecord(job.job_id.hex(), job.driver_pid, job.is_dead))
            if job.job_id.hex() == self.job_id:
                # This agent's own job, and so its workers whenever Ray starts one: never a test's.
                continue
            # Dead jobs too: a driver that called ray.shutdown() leaves its detached actors behind. A pid
            # means something only on its own host.
            since = drivers.get(job.driver_pid)
            if since is not None and job.start_time / 1000.0 >= since and job.driver_ip_address == here:
                jobs.append(job.job_id.hex())
        actors = []
        for raw in accessor.get_actor_table(None, None):
            a = gcs_pb2.ActorTableData.FromString(raw)
            actors.append(ActorRecord(a.actor_id.hex(), a.job_id.hex(), a.address.node_id.hex(), a.pid,
                                      gcs_pb2.ActorTableData.ActorState.Name(a.state), a.start_time / 1000.0,
                                      a.name, a.ray_namespace, a.is_detached, a.class_name))
        our_jobs = set(jobs)
        nodes = ray.nodes()
        dead = tuple((n["NodeID"], n.get("DeathReasonMessage") or "dead") for n in nodes
                     if not n["Alive"] and n["NodeID"] in self.known_alive)
        alive = [n["NodeID"] for n in nodes if n["Alive"]]
        gpus = {n["NodeID"]: float(n.get("Resources", {}).get("GPU", 0.0)) for n in nodes if n["Alive"]}
        workers = {node: sorted(a.pid for a in actors if a.node_id == node and a.job_id in our_jobs
                                and a.state == "ALIVE" and a.pid) for node in alive}
        refs = {node: self.probe.options(scheduling_strategy=self.affinity(node, soft=False)).remote(
            sorted(our_jobs), gpus[node], workers[node]) for node in alive}
        reports = []
        deadline = started + timeout
        for node, ref in refs.items():
            try:
                reports.append(ray.get(ref, timeout=max(0.1, deadline - time.monotonic())))
            except Exception as exc:  # a node that died or hangs: a finding, not a hang
                ray.cancel(ref, force=True)
                reports.append(NodeReport(node, 0, (), (), f"probe failed: {type(exc).__name__}: "
                                          f"{str(exc).splitlines()[0] if str(exc) else ''}"))
        took = time.monotonic() - started
        return Census(tuple(reports), dead, tuple(actors), tuple(sorted(our_jobs)), took, tuple(all_jobs))

    def end(self, node: str, raylet: int, actors: Sequence[NamedActor],
            targets: Sequence[tuple[int, int, str]], grace: float, release_wait: float, timeout: float
            ) -> NodeEnd:
        ref = self.ender.options(scheduling_strategy=self.affinity(node, soft=False)).remote(
            list(actors), list(targets), raylet, grace, release_wait)
        end: NodeEnd = self.ray.get(ref, timeout=timeout)
        return end


def main(address: str, read_fd: int, write_fd: int) -> int:
    """Connect to the cluster at ``address``, say so (``("ready", ray version)``), then answer each request
    read from ``read_fd`` on ``write_fd`` until the pytest process closes the pipe."""
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    try:
        agent = _Agent(address)
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        outbox.send(("error", f"Ray is not installed for {sys.executable} (pip install ray)"))
        return 1
    except BaseException as exc:  # unreachable, another version: say so and stop
        outbox.send(("error", f"{type(exc).__name__}: {exc}"))
        return 1
    outbox.send(("ready", agent.version))
    while True:
        try:
            request = inbox.recv()
        except EOFError:
            return 0
        op, args = request
        try:
            outbox.send(("ok", getattr(agent, op)(*args)))
        except Exception as exc:
            outbox.send(("error", f"{type(exc).__name__}: {exc}"))


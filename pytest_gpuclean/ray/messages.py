"""What crosses the Ray extension's process boundaries: what a node returns (``node.py``, through Ray), what
the agent sends the pytest process over its pipe, and the named actors a reaping is asked to end.

All are NamedTuples, pickled as they are both ways: one record from the node to the verdict, no dicts.
"""


from __future__ import annotations

from typing import NamedTuple

from pytest_gpuclean._model.records import DeviceSnapshot, ProcessInfo

# ---- what a node returns (inside a Ray worker: ``node.py``) --------------------------------------------


class NodeProcess(NamedTuple):
    """A process on a node that matters to the check: on a device, or of a watched job."""

    info: ProcessInfo
    job_id: str
    """``RAY_JOB_ID`` from its environment ('' when none)."""
    start_wall: float
    ray_worker: bool
    """A Ray worker (its title starts with ``ray::``)."""


class NodeReport(NamedTuple):
    """One node's devices and the processes that matter."""

    node_id: str
    raylet_pid: int
    devices: tuple[DeviceSnapshot, ...]
    processes: tuple[NodeProcess, ...]
    error: str = ""


class NamedActor(NamedTuple):
    """A named actor for ``node.end_on_node`` to ``ray.kill``, only if its name still resolves to
    ``actor_id``; its worker is watched until gone."""

    name: str
    namespace: str
    actor_id: str
    pid: int
    """Its worker, per the control store."""
    start_ticks: int
    """0 when the worker's process was not found on the node."""


Outcome = tuple[int, str, str, float | None, str]
"""What ``node.end_on_node`` did to one process: (pid, via, ended_by, exit_s, state when it survived)."""


class NodeEnd(NamedTuple):
    """What ``node.end_on_node`` did on one node."""

    outcomes: tuple[Outcome, ...]
    release_s: float | None
    """From the first kill until the node's devices listed none of the ended GPU holders."""
    held: tuple[int, ...]
    """The targets the node's devices listed when the reaping began."""
    errors: tuple[str, ...]


# ---- what the agent reads of the control store (``agent.py``) -------------------------------------------


class ActorRecord(NamedTuple):
    """An actor as the control store records it."""

    actor_id: str
    job_id: str
    node_id: str
    pid: int
    state: str
    start_wall: float
    name: str
    namespace: str
    detached: bool
    class_name: str


class JobRecord(NamedTuple):
    """A job (one driver) as the control store records it."""

    job_id: str
    driver_pid: int
    dead: bool
    """Its driver has disconnected (``ray.shutdown()`` or exited)."""


class Census(NamedTuple):
    """The cluster at one moment: nodes, actors, our jobs, and each alive node's report."""

    nodes: tuple[NodeReport, ...]
    dead_nodes: tuple[tuple[str, str], ...]
    """(node id, why) of nodes that died since the agent connected."""
    actors: tuple[ActorRecord, ...]
    our_jobs: tuple[str, ...]
    took_s: float
    jobs: tuple[JobRecord, ...] = ()
    """Every job the control store knows: ``gpuclean reap --ray`` asks whether one is over."""

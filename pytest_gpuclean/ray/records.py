"""What crosses the Ray extension's process boundaries, as records (``model/records.py``'s ``Fields``): what a
node's probe and reaping return (``node.py``, inside a Ray worker, shipped back by Ray), what the agent
(``agent.py``, a driver of its own) sends the pytest process over its pipe (``cluster.py``), and the named
actors a reaping is asked to end (the other way: pytest process or CLI, agent, node).

Both ways pickle them: Ray ships a task's result with its own pickler, the agent's pipe with ``pickle``. A
``Fields`` record has slots and no ``__dict__``; pickle (protocol 2 and later, what both use) saves and
restores its slots as they are, without its ``__init__`` (tests/test_ray.py pickles each one, and through
cloudpickle where it is installed, as Ray does). So each is the one record from the node to the verdict: no
dicts at the boundary.
"""



from __future__ import annotations

from typing import Final

from pytest_gpuclean.model.records import DeviceSnapshot, Fields, ProcessInfo

__all__ = [
    "ActorRecord",
    "Census",
    "JobRecord",
    "NamedActor",
    "NodeEnd",
    "NodeProcess",
    "NodeReport",
    "Outcome",
]


# ---- what a node returns (inside a Ray worker: ``node.py``) --------------------------------------------


class NodeProcess(Fields):
    """A process on a node that matters to the check: on a device, or of a watched job."""

    __slots__ = ("info", "job_id", "start_wall", "ray_worker")
    info: Final[ProcessInfo]
    job_id: Final[str]
    """``RAY_JOB_ID`` from its environment ('' when none)."""
    start_wall: Final[float]
    ray_worker: Final[bool]
    """A Ray worker (its title starts with ``ray::``)."""

    def __init__(self, info: ProcessInfo, job_id: str, start_wall: float, ray_worker: bool) -> None:
        self.info = info
        self.job_id = job_id
        self.start_wall = start_wall
        self.ray_worker = ray_worker


class NodeReport(Fields):
    """One node's devices and the processes that matter, as its probe saw them."""

    __slots__ = ("node_id", "raylet_pid", "devices", "processes", "error")
    node_id: Final[str]
    raylet_pid: Final[int]
    devices: Final[tuple[DeviceSnapshot, ...]]
    processes: Final[tuple[NodeProcess, ...]]
    error: Final[str]

    def __init__(self, node_id: str, raylet_pid: int, devices: tuple[DeviceSnapshot, ...],
                 processes: tuple[NodeProcess, ...], error: str = "") -> None:
        self.node_id = node_id
        self.raylet_pid = raylet_pid
        self.devices = devices
        self.processes = processes
        self.error = error


class NamedActor(Fields):
    """A named actor for ``node.end_on_node`` to end by ``ray.kill``: looked up by its name, killed only if
    the name still resolves to ``actor_id``; its worker (``pid``, ``start_ticks``) is watched until gone."""

    __slots__ = ("name", "namespace", "actor_id", "pid", "start_ticks")
    name: Final[str]
    namespace: Final[str]
    actor_id: Final[str]
    pid: Final[int]
    """Its worker, as the control store names it."""
    start_ticks: Final[int]
    """The worker's start time (0 when its process was not found on the node)."""

    def __init__(self, name: str, namespace: str, actor_id: str, pid: int, start_ticks: int) -> None:
        self.name = name
        self.namespace = namespace
        self.actor_id = actor_id
        self.pid = pid
        self.start_ticks = start_ticks


Outcome = tuple[int, str, str, float | None, str]
"""What ``node.end_on_node`` did to one process: (pid, via, ended_by, exit_s, state); via ``ray.kill`` or
``ladder``; state when it survived."""


class NodeEnd(Fields):
    """What ``node.end_on_node`` did on one node."""

    __slots__ = ("outcomes", "release_s", "held", "errors")
    outcomes: Final[tuple[Outcome, ...]]
    release_s: Final[float | None]
    """Seconds from the first kill until the node's devices listed none of the ended GPU holders."""
    held: Final[tuple[int, ...]]
    """The targets the node's devices listed when the reaping began."""
    errors: Final[tuple[str, ...]]

    def __init__(self, outcomes: tuple[Outcome, ...], release_s: float | None, held: tuple[int, ...],
                 errors: tuple[str, ...]) -> None:
        self.outcomes = outcomes
        self.release_s = release_s
        self.held = held
        self.errors = errors


# ---- what the agent reads of the control store (``agent.py``) -------------------------------------------


class ActorRecord(Fields):
    """An actor as the control store records it."""

    __slots__ = ("actor_id", "job_id", "node_id", "pid", "state", "start_wall", "name", "namespace",
                 "detached", "class_name")
    actor_id: Final[str]
    job_id: Final[str]
    node_id: Final[str]
    pid: Final[int]
    state: Final[str]
    start_wall: Final[float]
    name: Final[str]
    namespace: Final[str]
    detached: Final[bool]
    class_name: Final[str]

    def __init__(self, actor_id: str, job_id: str, node_id: str, pid: int, state: str, start_wall: float,
                 name: str, namespace: str, detached: bool, class_name: str) -> None:
        self.actor_id = actor_id
        self.job_id = job_id
        self.node_id = node_id
        self.pid = pid
        self.state = state
        self.start_wall = start_wall
        self.name = name
        self.namespace = namespace
        self.detached = detached
        self.class_name = class_name


class JobRecord(Fields):
    """A job (one driver) as the control store records it."""

    __slots__ = ("job_id", "driver_pid", "dead")
    job_id: Final[str]
    driver_pid: Final[int]
    dead: Final[bool]
    """Its driver has disconnected (``ray.shutdown()`` or exited)."""

    def __init__(self, job_id: str, driver_pid: int, dead: bool) -> None:
        self.job_id = job_id
        self.driver_pid = driver_pid
        self.dead = dead


class Census(Fields):
    """The cluster at one moment: nodes, actors, which jobs are ours, and each alive node's report."""

    __slots__ = ("nodes", "dead_nodes", "actors", "our_jobs", "took_s", "jobs")
    nodes: Final[tuple[NodeReport, ...]]
    dead_nodes: Final[tuple[tuple[str, str], ...]]
    """(node id, why) of nodes that died since the agent connected."""
    actors: Final[tuple[ActorRecord, ...]]
    our_jobs: Final[tuple[str, ...]]
    took_s: Final[float]
    jobs: Final[tuple[JobRecord, ...]]
    """Every job the control store knows (for ``gpuclean reap --ray``: is a job over?)."""

    def __init__(self, nodes: tuple[NodeReport, ...], dead_nodes: tuple[tuple[str, str], ...],
                 actors: tuple[ActorRecord, ...], our_jobs: tuple[str, ...], took_s: float,
                 jobs: tuple[JobRecord, ...] = ()) -> None:
        self.nodes = nodes
        self.dead_nodes = dead_nodes
        self.actors = actors
        self.our_jobs = our_jobs
        self.took_s = took_s
        self.jobs = jobs

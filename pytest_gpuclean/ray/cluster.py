"""The check across a Ray cluster (``--gpuclean-ray``): every alive node's devices and the test's Ray
actors and processes, through Ray's own records.

The pytest process never imports Ray. A helper driver (``_agent_main``, in a Python process of its own),
a job of its own, reads the control store's tables (no dashboard needed), runs a probe pinned to each
node (node affinity, ``num_cpus=0`` so that a busy node still answers) and ends what the check decides
is a test's leak. It talks to the pytest process over a pipe; every request has a deadline, and an
agent that misses it is killed and reported, so an unreachable cluster never hangs a test.

Attribution: a Ray actor belongs to a test when its job's driver is this pytest process and Ray's
record says it started inside the test's window (the same windows as the local check); a process on
a node belongs to it through its actor's worker (ancestry), or when it carries the job's id
(``RAY_JOB_ID``, inherited by every process a worker starts) and was born inside the window. Ray's
daemons, idle workers (``ray::IDLE``), another job's actors and other users' processes are never
signalled.
"""

from __future__ import annotations

import fnmatch
import importlib
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, cast, get_args

from pytest_gpuclean.core.options import settings
from pytest_gpuclean.core.ownership.evidence import SESSION, Ownership
from pytest_gpuclean.core.reading import procfs
from pytest_gpuclean.model.records import (
    MIB,
    CheckResult,
    ClusterReading,
    DeviceInfo,
    DeviceSnapshot,
    EndedBy,
    NodeReading,
    NodeRelease,
    Offender,
    Owner,
    Phase,
    ProcessInfo,
    Reaped,
)

if TYPE_CHECKING:
    from pytest_gpuclean.core.reading.backends import Backend

OFF = "off"
AUTO = "auto"
# Without these, ray.init to a dead address retries for about 14 minutes before it gives up.
CONNECT_ENV = {
    "RAY_gcs_server_port_wait_time_s": "1",
    "RAY_py_gcs_connect_timeout_s": "2",
    "RAY_gcs_rpc_server_connect_timeout_s": "1",
    # A GCS that goes away (the cluster shut down under a session) would hold each request of the agent
    # for a minute (Ray's default): give up after a few seconds instead.
    "RAY_gcs_rpc_server_reconnect_timeout_s": "3",
}
RAY_DAEMONS = ("raylet", "gcs_server", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::IDLE",
               "dashboard.py", "log_monitor.py", "monitor.py", "runtime_env/agent")


# Not ``-m``: what the agent pickles (results, the probe Ray ships to the nodes) must name this module,
# not ``__main__``.
AGENT_COMMAND = ("import sys; from pytest_gpuclean.ray.cluster import _agent_main; "
                 "sys.exit(_agent_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))")


class ClusterError(Exception):
    """The cluster cannot be reached or used (wrong address, Ray missing, another Ray version)."""


# ---- what a node probe returns (plain data, pickled through Ray) -------------------------------------


@dataclass(frozen=True)
class NodeProcess:
    """A process on a node that matters to the check: on a device, or of a watched job."""

    info: ProcessInfo
    job_id: str
    """``RAY_JOB_ID`` from its environment ('' when none)."""
    start_wall: float
    ray_worker: bool
    """A Ray worker (its title starts with ``ray::``)."""


@dataclass(frozen=True)
class NodeReport:
    """One node's devices and the processes that matter, as its probe saw them."""

    node_id: str
    raylet_pid: int
    devices: tuple[DeviceSnapshot, ...]
    processes: tuple[NodeProcess, ...]
    error: str = ""


@dataclass(frozen=True)
class ActorRecord:
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


@dataclass(frozen=True)
class JobRecord:
    """A job (one driver) as the control store records it."""

    job_id: str
    driver_pid: int
    dead: bool
    """Its driver has disconnected (``ray.shutdown()`` or exited)."""


@dataclass(frozen=True)
class NodeEnd:
    """What ``end_on_node`` did on one node."""

    outcomes: tuple[tuple[int, str, str, float | None, str], ...]
    """(pid, via, ended_by, exit_s, state): via ``ray.kill`` or ``ladder``; state when it survived."""
    release_s: float | None
    """Seconds from the first kill until the node's devices listed none of the ended GPU holders."""
    held: tuple[int, ...]
    """The targets the node's devices listed when the reaping began."""
    errors: tuple[str, ...]


@dataclass(frozen=True)
class Census:
    """The cluster at one moment: nodes, actors, which jobs are ours, and each alive node's report."""

    nodes: tuple[NodeReport, ...]
    dead_nodes: tuple[tuple[str, str], ...]
    """(node id, why) of nodes that died since the agent connected."""
    actors: tuple[ActorRecord, ...]
    our_jobs: tuple[str, ...]
    took_s: float
    jobs: tuple[JobRecord, ...] = ()
    """Every job the control store knows (for ``gpuclean reap --ray``: is a job over?)."""


# ---- node side ------------------------------------------------------------------------------------


def probe_node(jobs: Sequence[str], gpus: float | None = None, actor_pids: Sequence[int] = ()) -> NodeReport:
    """On a node (inside a Ray worker): its devices and the processes that matter, this user's only.

    ``gpus`` is the node's "GPU" resource as the control store has it (see ``node_devices``);
    ``actor_pids`` the workers the control store names for the watched jobs' actors on this node: a worker
    Ray started before the job asked for it has no ``RAY_JOB_ID`` in its environment.
    """
    from pytest_gpuclean.core.reading import devices, processes

    raylet = int(os.environ.get("RAY_RAYLET_PID", "0"))
    node_id = _node_id()
    snaps: tuple[DeviceSnapshot, ...] = ()
    error = ""
    simulated = os.environ.get(settings.option("simulate").env_var) or None
    try:
        backend = _open_backend(simulated)
    except devices.DeviceError:
        backend = None  # a node without GPUs (or NVML): its processes still count
    if backend is not None:
        try:
            listed = backend.devices()
            owned = listed if simulated else node_devices(listed, raylet, gpus)
            snaps = backend.readings(owned)
        except devices.DeviceError as exc:
            error = f"devices unreadable: {exc}"
        finally:
            backend.close()
    on_device = {p.pid for s in snaps for p in s.processes}
    uid = os.getuid()
    me = os.getpid()
    found: list[NodeProcess] = []
    named = set(actor_pids)
    for pid in actor_pids:  # and what those workers started
        named.update(child for child, _ in procfs.descendants(pid))
    for pid in set(procfs.pids_of_uid(uid)) | on_device:
        if pid == me:
            continue
        env = procfs.read_environ_vars(pid, ("RAY_RAYLET_PID", "RAY_JOB_ID"))
        job = env.get("RAY_JOB_ID", "")
        # A process of a watched job on this node (its raylet's), or anything a device lists.
        if pid not in on_device and pid not in named and not (
                job in jobs and env.get("RAY_RAYLET_PID") == str(raylet)):
            continue
        info = processes.describe(pid)
        if info is None:
            continue
        found.append(NodeProcess(info, job, procfs.ticks_to_wall(info.start_ticks),
                                 info.cmdline.startswith("ray::")))
    return NodeReport(node_id, raylet, _named(snaps, node_id), tuple(found), error)


def node_devices(listed: Sequence[DeviceInfo], raylet_pid: int, gpus: float | None) -> tuple[DeviceInfo, ...]:
    """The GPUs of the host that belong to this Ray node.

    Several raylets can share a host (a test cluster, or one raylet per GPU): NVML shows each of them
    every GPU, and a GPU seen by two nodes would be checked, and its holders blamed, twice. A raylet owns
    what its ``CUDA_VISIBLE_DEVICES`` lists (Ray schedules GPU tasks within it); without the variable Ray
    numbers the node's ``GPU`` resource from the first device on, and a node with no ``GPU`` resource
    owns none.
    """
    from pytest_gpuclean.core.reading import backends, devices

    visible = procfs.read_environ_vars(raylet_pid, ("CUDA_VISIBLE_DEVICES",)).get("CUDA_VISIBLE_DEVICES") \
        if raylet_pid > 0 else None
    if visible is not None:
        try:
            return backends.select_devices(listed, visible, cuda_ordinals=True,
                                           ordinal_uuids=backends.cuda_ordinal_uuids())
        except devices.DeviceSelectionError:
            return tuple(listed)  # not ours to judge: check them all rather than none
    if gpus is None:
        return tuple(listed)
    return tuple(sorted(listed, key=lambda d: d.index))[:int(gpus)]


def end_on_node(actors: Sequence[tuple[str, str, str, int, int]], targets: Sequence[tuple[int, int, str]],
                raylet_pid: int, grace: float, release_wait: float) -> NodeEnd:
    """On a node: ``ray.kill`` of named actors ``(name, namespace, actor id, worker pid, start ticks)``,
    then the TERM -> grace -> KILL ladder for the ``(pid, start ticks, job id)`` targets still alive,
    then wait (up to ``release_wait``) until the node's devices list none of what was ended, timed on
    this node from the first kill.

    Each target is checked again here, where the pid means something: same start time, this user's,
    this node's raylet, the job the check blamed (or, for ``job id`` '', no Ray job at all); never this
    task's own ancestors (its worker's raylet, the process that started the node). An actor is killed
    only if its name still resolves to the same actor id.
    """
    from pytest_gpuclean.core.reading import devices, processes

    begun = time.monotonic()
    uid = os.getuid()
    never = processes.ancestors(os.getpid())
    backend = None
    try:
        backend = _open_backend(os.environ.get(settings.option("simulate").env_var) or None)
        listed_devices = backend.devices()
    except devices.DeviceError:
        listed_devices = ()

    def on_devices() -> set[int]:
        if backend is None:
            return set()
        try:
            return {p.pid for s in backend.readings(listed_devices) for p in s.processes}
        except devices.DeviceError:
            return set()

    wanted = {pid for pid, _, _ in targets} | {a[3] for a in actors}
    held = on_devices() & wanted
    released: list[float] = []

    def watch() -> None:
        if held and not released and not (on_devices() & held):
            released.append(time.monotonic() - begun)

    errors: list[str] = []
    outcomes: list[tuple[int, str, str, float | None, str]] = []
    ray = _ray()
    by_ray: dict[int, tuple[int, float]] = {}
    for name, namespace, actor_id, pid, start_ticks in actors:
        try:
            handle = ray.get_actor(name, namespace=namespace)
            if handle._actor_id.hex() != actor_id:
                errors.append(f"actor {name!r} is now another actor: left alone")
                continue
            sent = time.monotonic()
            ray.kill(handle, no_restart=True)
            by_ray[pid] = (start_ticks, sent)
        except Exception as exc:
            errors.append(f"ray.kill of actor {name!r} failed: {type(exc).__name__}: {exc}")
    # Ray ends a killed actor's worker at once (about 10 ms); the ladder takes what is still there after
    # the grace period.
    deadline = time.monotonic() + grace
    pending = dict(by_ray)
    while pending and time.monotonic() < deadline:
        for pid, (start_ticks, sent) in list(pending.items()):
            stat = procfs.read_stat(pid)
            if stat is None or stat.start_ticks != start_ticks or stat.state == "Z":
                outcomes.append((pid, "ray.kill", "ray.kill", time.monotonic() - sent, ""))
                del pending[pid]
        watch()
        time.sleep(0.005)
    done = {o[0] for o in outcomes}
    verified: list[processes.KillTarget] = []
    for pid, start_ticks, job in targets:
        if pid in done:
            continue
        stat = procfs.read_stat(pid)
        env = procfs.read_environ_vars(pid, ("RAY_RAYLET_PID", "RAY_JOB_ID"))
        if stat is None or stat.start_ticks != start_ticks:
            outcomes.append((pid, "ladder", "already exited" if stat is None else "pid reused", None, ""))
        elif pid in never or os.stat(f"/proc/{pid}").st_uid != uid or env.get("RAY_JOB_ID", "") != job or (
                job and env.get("RAY_RAYLET_PID") != str(raylet_pid)):
            outcomes.append((pid, "ladder", "survived", None, "not provably the test's: left alone"))
        else:
            verified.append(processes.KillTarget(pid, start_ticks, 0, None))
    for o in processes.terminate(verified, grace, watch=watch):
        outcomes.append((o.pid, "ladder", o.ended_by, o.exit_s, o.state))
    limit = time.monotonic() + release_wait
    while held and not released and time.monotonic() < limit:
        watch()
        if not released:
            time.sleep(0.01)
    if backend is not None:
        backend.close()
    return NodeEnd(tuple(outcomes), released[0] if released else None, tuple(sorted(held)), tuple(errors))


def _open_backend(simulate_dir: str | None) -> Backend:
    """The node's devices, as ``core.reading.opening.open_backend`` opens them (NVML without an early start).
    Not that function: this module is four floors down the ``gpuclean`` command's imports (``__main__``,
    ``cli``, ``cli_ray``), and the opener's own floor above the backends would make seven
    (tests/test_layers.py allows six)."""
    if simulate_dir:
        from pytest_gpuclean.core.reading.simulated import SimulatedBackend

        return SimulatedBackend(simulate_dir)
    from pytest_gpuclean.core.reading.nvml import NvmlBackend

    return NvmlBackend()


def _node_id() -> str:
    ray = _ray()
    return str(ray.get_runtime_context().get_node_id())


def _ray() -> Any:
    # Typed as Any: Ray is optional, and mypy must pass where it is not installed.
    return importlib.import_module("ray")


def _named(snaps: tuple[DeviceSnapshot, ...], node_id: str) -> tuple[DeviceSnapshot, ...]:
    # Devices carry their node in the name, so that reports across nodes say where a GPU is.
    out = []
    for s in snaps:
        device = DeviceInfo(s.device.index, s.device.uuid, f"node {node_id[:8]}: {s.device.name}",
                            s.device.mig_index)
        out.append(DeviceSnapshot(device, s.used_bytes, s.total_bytes, s.processes))
    return tuple(out)


# ---- the agent: a driver of its own ------------------------------------------------------------------


class _Agent:
    def __init__(self, address: str) -> None:
        ray = self.ray = _ray()
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
        """``drivers``: pids on this host whose jobs are ours, each with the earliest start such a job
        may have (a job older than its driver's process belongs to an earlier process of that pid)."""
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
                # This agent's own job, as Ray named it when the agent connected: the plugin's helper, and
                # so are its workers, whenever Ray starts one (the probes' workers start on a node at its
                # first check, and again once Ray has let an idle one go). Never a test's.
                continue
            # Dead jobs too: a driver that called ray.shutdown() leaves its detached actors behind. A pid
            # means something only on its own host: the driver must run where this agent does.
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

    def end(self, node: str, raylet: int, actors: Sequence[tuple[str, str, str, int, int]],
            targets: Sequence[tuple[int, int, str]], grace: float, release_wait: float, timeout: float
            ) -> NodeEnd:
        ref = self.ender.options(scheduling_strategy=self.affinity(node, soft=False)).remote(
            list(actors), list(targets), raylet, grace, release_wait)
        end: NodeEnd = self.ray.get(ref, timeout=timeout)
        return end


def _agent_main(address: str, read_fd: int, write_fd: int) -> int:
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


# ---- the pytest side ------------------------------------------------------------------------------


@dataclass
class _Leak:
    process: NodeProcess | None
    actor: ActorRecord | None
    node: str
    token: str


@dataclass
class RayCheck:
    """Drives the agent from the pytest process: census, attribution, reaping, the verdict."""

    address: str
    ownership: Ownership
    reap: bool = True
    grace: float = settings.DEFAULT_GRACE_S
    agent_env: dict[str, str] = field(default_factory=dict)
    """Set in the agent's environment (the session's cookie: the agent is the session's helper)."""
    _proc: subprocess.Popen[bytes] | None = None
    _inbox: Connection | None = None
    _outbox: Connection | None = None
    version: str = ""
    since: float = field(default_factory=lambda: _process_start(os.getpid()))
    """Jobs whose driver is this process and started since then are this session's: a job started before
    this process existed had a driver of the same pid (reused)."""
    notes: list[str] = field(default_factory=list)
    unreachable: str = ""
    """Why the last check could not reach the cluster ('' when it could)."""
    _tree: procfs.DescendantWalk = field(default_factory=procfs.DescendantWalk, repr=False)
    """This process's descendants, walked at a cost independent of its thread count (as the checker's)."""
    older: Callable[[int, int], bool] = field(default=lambda pid, start_ticks: False, repr=False)
    """Whether a descendant (pid, start ticks) is no part of the session: it existed before it (the local
    checker says so). Such a driver's jobs are not the session's, nor are those of what it starts."""

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

    def end(self, node: str, raylet: int, actors: Sequence[tuple[str, str, str, int, int]],
            targets: Sequence[tuple[int, int, str]], grace: float, release_wait: float, timeout: float
            ) -> NodeEnd:
        """``end_on_node`` on ``node`` (see there)."""
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
            # A window's ticks are truncated (1/CLOCK_TICKS s), the control store's times are not: a window
            # ends up to one tick after its end tick. An actor a fixture waited for before it returned
            # started before the fixture's window closed, often in that last tick.
            end = procfs.ticks_to_wall(window.end_tick + 1) if window.end_tick is not None else time.time()
            if start <= wall <= end:
                return window.token
        return SESSION

    def leaks(self, census: Census, sweep: str = "") -> list[_Leak]:
        """What of ours is alive on the cluster and not protected (an active fixture's, the session's).

        ``sweep``: at session end, ``"tests"`` takes everything of the tests and fixtures (whose windows
        are all closed), ``"all"`` the session set-up's too.
        """
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
                # The control store's record decides whose worker this is, whatever its environment says
                # (a prestarted worker has no RAY_JOB_ID): unless it started after the actor did.
                actor_leak = actor_by_pid.get((node.node_id, p.info.pid))
                if actor_leak is not None and actor_leak.actor is not None and \
                        p.start_wall <= actor_leak.actor.start_wall + 1.0:
                    actor_leak.process = p
                    continue
                if p.ray_worker:
                    continue  # a task worker, idle or not, is Ray's to reuse; only what it started is a leak
                # Ancestry first: a subprocess of an actor's worker is that actor's (its environment may
                # name no job either).
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
        """This process and its live descendants, as drivers of Ray jobs: a test's job is started by pytest
        itself or by a process the test started (vLLM's engine process connects to Ray as a driver of its
        own and places its workers there)."""
        drivers = {os.getpid(): self.since}
        older: set[int] = set()
        for pid, _, parent in self._tree.walk(os.getpid()):
            if pid == self.agent_pid:
                continue  # the plugin's own helper driver (its job is left out by the agent too)
            stat = procfs.read_stat(pid)
            if stat is None:
                continue
            if parent in older or self.older(pid, stat.start_ticks):
                older.add(pid)  # (`driver & exec pytest`: its jobs were never the session's)
                continue
            drivers[pid] = max(self.since, procfs.ticks_to_wall(stat.start_ticks) - 0.5)
        return drivers

    def check_cluster(self, phase: Phase, *, tolerance_mib: int, timeout: float, sweep: str = ""
                      ) -> CheckResult:
        """Check every alive node; reap the test's leaks (Ray first, then the ladder on the node). Its
        offenders and reaped name their node; ``cluster`` holds the nodes' devices.

        ``sweep`` (session end): only the session's leftovers matter, not the devices' state.
        """
        started = time.monotonic()
        notes: list[str] = []
        self.unreachable = ""
        # Once per check: the reaping below ends processes on the nodes, and a driver it took with it still
        # names the jobs whose leftovers the second census must see as ours.
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
        set-up) left on the cluster; only what is provably the session's (its jobs' actors and the
        processes their workers started)."""
        if include_session and self.unreachable:
            # The sweep after the last test could not reach it: do not wait for it a second time.
            return self.unreachable_result("check")
        return self.check_cluster("check", tolerance_mib=0, timeout=timeout,
                                  sweep="all" if include_session else "tests")

    def _reap(self, leaks: list[_Leak], census: Census, notes: list[str], timeout: float
              ) -> tuple[list[Reaped], list[NodeRelease]]:
        # Named actors end through Ray (ray.kill frees their GPU through Ray's own path); anonymous ones
        # cannot be looked up from another job, so their worker gets the ladder, which Ray sees as the
        # actor's death. Each node's reaping runs on that node, which times its devices' release.
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
                    actors.append((a.name, a.namespace, a.actor_id, a.pid, p.info.start_ticks if p else 0))
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
                results.append(node_reaped(
                    self._info(lk), self.ownership.owner(lk.token), outcome, self._held(lk, census), end,
                    node=node, actor_id=lk.actor.actor_id if lk.actor else "",
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
    """Dead nodes and unreadable nodes (``unreachable``), processes on a device that no explained job
    accounts for (foreign), and memory no process accounts for beyond the tolerance; each names its node."""
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
                info = (proc.info.replace(cmdline=f"{where} {proc.info.cmdline}")
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


def node_reaped(info: ProcessInfo, owner: Owner | None, outcome: tuple[int, str, str, float | None, str],
                held: tuple[tuple[str, float], ...], end: NodeEnd, *, node: str | None = None,
                actor_id: str = "", job_id: str = "") -> Reaped:
    """A node's answer ``(pid, via, ended_by, exit_s, state)`` for one process, as a ``Reaped`` on
    ``node``."""
    pid, via, ended, exit_s, state = outcome
    how = ended_by(via, ended)
    return Reaped(info, owner, "gpu", how, held, exit_s, end.release_s if pid in end.held else None,
                  survived_as=state if how == "survived" else "", node=node,
                  via="ray.kill" if via == "ray.kill" else "ladder", actor_id=actor_id, job_id=job_id)


def ended_by(via: str, ended: str) -> EndedBy:
    """How a node's outcome reads in a ``Reaped``: Ray ended a ``ray.kill``-ed actor's worker by itself
    (``via`` says how); anything the ladder cannot name survived."""
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
    """The address ``--gpuclean-ray`` names: None for ``off``; ``auto`` is ``RAY_ADDRESS`` if set (a cluster
    the session starts itself is found by ``checks.RayChecks.discover``)."""
    if value == OFF:
        return None
    if value == AUTO:
        return os.environ.get("RAY_ADDRESS") or None
    return value


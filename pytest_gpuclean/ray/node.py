"""What runs on each node of a Ray cluster, in a task of the agent's job pinned to it (``num_cpus=0``, so a
busy node still answers): ``probe_node`` reads it, ``end_on_node`` ends a test's leaks there.

Ray pickles these functions by reference: a node imports this module from its own installation.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Sequence
from typing import Any

from pytest_gpuclean import _settings as settings
from pytest_gpuclean._check import gate
from pytest_gpuclean._model.records import DeviceInfo, DeviceSnapshot
from pytest_gpuclean._reading import backends, credentials, devices, processes, procfs
from pytest_gpuclean._reading.backends import open_backend
from pytest_gpuclean.ray.messages import NamedActor, NodeEnd, NodeProcess, NodeReport, Outcome


def probe_node(jobs: Sequence[str], gpus: float | None = None, actor_pids: Sequence[int] = ()) -> NodeReport:
    """On a node: its devices and the processes that matter, this user's only.

    ``actor_pids``: the control store's workers of the watched jobs' actors here, since a worker Ray
    started before the job asked for it has no ``RAY_JOB_ID`` in its environment.
    """
    raylet = int(os.environ.get("RAY_RAYLET_PID", "0"))
    node_id = _node_id()
    snaps: tuple[DeviceSnapshot, ...] = ()
    error = ""
    simulated = os.environ.get(settings.option("simulate").env_var) or None
    try:
        backend = open_backend(simulated)
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

    Raylets sharing a host all see every GPU through NVML; a GPU seen by two would be checked, and its
    holders blamed, twice. A raylet owns what its ``CUDA_VISIBLE_DEVICES`` lists, else its ``GPU`` resource
    counted from the first device.
    """
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


def end_on_node(actors: Sequence[NamedActor], targets: Sequence[tuple[int, int, str]],
                raylet_pid: int, grace: float, release_wait: float) -> NodeEnd:
    """On a node: ``ray.kill`` the named ``actors``, run the signal ladder on the targets still alive, then
    wait (up to ``release_wait``) until the node's devices list none of them.

    Each target is checked again here, where its pid means something: same start time, this node's raylet,
    the blamed job ('' for none), and the signal gate (never another user's process, a relay to one, or
    this task's own ancestors).
    """
    begun = time.monotonic()
    uid = os.getuid()
    never = processes.ancestors(os.getpid())
    backend = None
    try:
        backend = open_backend(os.environ.get(settings.option("simulate").env_var) or None)
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

    wanted = {pid for pid, _, _ in targets} | {a.pid for a in actors}
    held = on_devices() & wanted
    released: list[float] = []

    def watch() -> None:
        if held and not released and not (on_devices() & held):
            released.append(time.monotonic() - begun)

    errors: list[str] = []
    outcomes: list[Outcome] = []
    ray = ray_module()
    by_ray: dict[int, tuple[int, float]] = {}
    for a in actors:
        try:
            handle = ray.get_actor(a.name, namespace=a.namespace)
            if handle._actor_id.hex() != a.actor_id:
                errors.append(f"actor {a.name!r} is now another actor: left alone")
                continue
            sent = time.monotonic()
            ray.kill(handle, no_restart=True)
            by_ray[a.pid] = (a.start_ticks, sent)
        except Exception as exc:
            errors.append(f"ray.kill of actor {a.name!r} failed: {type(exc).__name__}: {exc}")
    # Ray ends a killed actor's worker at once; the ladder takes what is still there after the grace.
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
        elif env.get("RAY_JOB_ID", "") != job or (job and env.get("RAY_RAYLET_PID") != str(raylet_pid)):
            outcomes.append((pid, "ladder", "survived", None, "not provably the test's: left alone"))
        elif (why := gate.refusal(credentials.credentials(pid, start_ticks), uid,
                                  itself=pid in never)) is not None:
            # The signal gate, as on this host: another user's process, a relay to one, ourselves.
            outcomes.append((pid, "ladder", "survived", None, f"left alone: {why}"))
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


def _node_id() -> str:
    ray = ray_module()
    return str(ray.get_runtime_context().get_node_id())


def ray_module() -> Any:
    """Ray, typed as Any: it is optional, and mypy must pass where it is not installed."""
    return importlib.import_module("ray")


def _named(snaps: tuple[DeviceSnapshot, ...], node_id: str) -> tuple[DeviceSnapshot, ...]:
    # Devices carry their node in the name, so reports say where a GPU is.
    out = []
    for s in snaps:
        device = DeviceInfo(s.device.index, s.device.uuid, f"node {node_id[:8]}: {s.device.name}",
                            s.device.mig_index)
        out.append(DeviceSnapshot(device, s.used_bytes, s.total_bytes, s.processes))
    return tuple(out)


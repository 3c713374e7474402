"""Benchmark 3: leak-to-clean latency on a real GPU, against the driver's own release time and vLLM's polling.

A "test" leaks a torch child holding ``--gib`` GiB (default 4) on GPU 0; gpuclean's teardown check
(``Checker.check``, which reaps) runs and we time it from its start to its clean verdict. Scenarios,
each ``--repeat`` times (vllm ``--vllm-repeat`` times), one holder at a time on an otherwise idle GPU:

* ``driver``: the reference. An identical holder is sent SIGTERM by hand while NVML is polled every
  ~1 ms: signal -> process exit -> gone from NVML's process list / used memory back to idle.
* ``reap_term`` (a): the leaked holder exits on SIGTERM. Target: latency <= driver release + 50 ms, with
  the plugin's default settle time (``--settle``, 1 s) as a user's check has it.
* ``reap_ignore`` (b): the leaked holder ignores SIGTERM; gpuclean escalates to SIGKILL after
  ``--grace`` (default 1 s here; the plugin's default is 5 s). Target: latency <= grace + 0.2 s.
* ``vllm``: the test's own cleanup sends SIGTERM (the best case for vLLM: nothing leaked unseen), then
  our equivalent of vLLM's ``wait_for_gpu_memory_to_clear`` polls NVML v1 every 5 s (threshold 2 GiB).

A sampler thread records device used memory (NVML v2) and whether the holder is listed, every ~2 ms,
with marks for teardown start, each signal (the checker's own, recorded by wrapping
``processes._signal``), process exit (a pidfd), gone from NVML, and the verdict. Everything goes to
``--out`` (``release_results.json``, ``release_timeline.json``, holder logs); ``plot_timeline.py``
draws the timeline.

Holders are started ahead, in parallel: each imports torch and waits for a "go" line on stdin before it
creates its CUDA context and allocates, so the slow imports overlap. Waiting holders hold no GPU memory
and belong to a protected (fixture-like) owner, so the checker leaves them alone; a holder becomes a
"leak" (unprotected) when its test ends.

``--simulate`` runs the same logic without a GPU: simulated devices in a temporary directory and holders
that record their "allocation" there instead of importing torch (the driver's release is then instant).

    python3 benchmarks/bench_release_gpu.py --out $OUT            # on the GPU box (about 1 minute)
    python benchmarks/bench_release_gpu.py --simulate --out /tmp/rel
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

import _common  # noqa: E402

PACKAGE = _common.measure_this_tree()
import _layers_compat  # noqa: E402, F401  # (a tree from before the layers: issue 29)

from pytest_gpuclean._check.checker import Checker, CheckSettings  # noqa: E402
from pytest_gpuclean._model.records import MIB, DeviceInfo, Owner  # noqa: E402
from pytest_gpuclean._ownership.cookie import COOKIE_VAR  # noqa: E402
from pytest_gpuclean._reading import processes  # noqa: E402
from pytest_gpuclean._reading.nvml import NvmlBackend  # noqa: E402
from pytest_gpuclean._reading.simulated import SimulatedBackend  # noqa: E402

HOLDER = r"""
import os, signal, sys, time
mode, gib, ignore = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1"
ready, sim_dir = sys.argv[4], sys.argv[5]
if ignore:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "torch":
    import torch
sys.stdin.readline()  # "go": create the context and allocate now
if mode == "torch":
    x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    x.fill_(1)
    torch.cuda.synchronize()
else:
    from pytest_gpuclean.simulate import allocate
    allocate(sim_dir, 0, gib * 1024)
with open(ready + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(ready + ".tmp", ready)
while True:
    time.sleep(3600)
"""


# ---- reading the device ------------------------------------------------------------------------

class Probe:
    """One device's used memory (v2) and listed pids, safe to call from the sampler thread."""

    def __init__(self, backend: Any, device: DeviceInfo) -> None:
        self.backend = backend
        self.device = device
        self.lock: Any = getattr(backend, "_lock", None) or threading.Lock()
        self.real = backend.kind == "nvml"
        if self.real:
            import pynvml

            self.nvml = pynvml
            self.handle = backend._handles[device.uuid]

    def sample(self) -> tuple[int, frozenset[int]]:
        if not self.real:
            snap = self.backend.snapshot(self.device)
            return snap.used_bytes, frozenset(p.pid for p in snap.processes)
        nvml = self.nvml
        with self.lock:  # pynvml calls must not interleave across threads (the backend's own lock)
            used = int(nvml.nvmlDeviceGetMemoryInfo(self.handle, version=nvml.nvmlMemory_v2).used)
            pids = frozenset(p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(self.handle))
        return used, pids

    def used_v1(self) -> tuple[int, int]:
        if not self.real:
            snap = self.backend.snapshot(self.device)
            return snap.used_bytes, snap.total_bytes
        with self.lock:
            info = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        return int(info.used), int(info.total)


@dataclass
class Timeline:
    name: str
    run: int
    t0: float
    samples: list[tuple[float, float, bool]] = field(default_factory=list)
    """(ms since t0, used MiB, holder listed)"""
    marks: list[tuple[float, str]] = field(default_factory=list)

    def mark(self, label: str, at: float | None = None) -> None:
        self.marks.append((((at if at is not None else time.monotonic()) - self.t0) * 1e3, label))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "run": self.run, "samples": self.samples,
                "marks": [{"t_ms": t, "label": label} for t, label in sorted(self.marks)]}


class Sampler(threading.Thread):
    """Samples the device every ``period`` s into a timeline; notes the holder's exit and disappearance."""

    def __init__(self, probe: Probe, timeline: Timeline, pid: int, pidfd: int | None, period: float,
                 idle_bytes: int) -> None:
        super().__init__(daemon=True, name="gpuclean-bench-sampler")
        self.probe, self.timeline, self.pid, self.pidfd = probe, timeline, pid, pidfd
        self.period = period
        self.idle_bytes = idle_bytes
        self.stop_event = threading.Event()
        self.exited_at: float | None = None
        self.gone_at: float | None = None
        self.idle_at: float | None = None

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.once()
            time.sleep(self.period)
        self.once()

    def once(self) -> None:
        used, pids = self.probe.sample()
        now = time.monotonic()
        listed = self.pid in pids
        self.timeline.samples.append(((now - self.timeline.t0) * 1e3, used / MIB, listed))
        if self.exited_at is None and _exited(self.pid, self.pidfd):
            self.exited_at = now
            self.timeline.mark("exited", now)
        if self.gone_at is None and not listed:
            self.gone_at = now
            self.timeline.mark("gone from NVML", now)
        if self.idle_at is None and used <= self.idle_bytes:
            self.idle_at = now
            self.timeline.mark("memory back to idle", now)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=5)


def _exited(pid: int, pidfd: int | None) -> bool:
    if pidfd is not None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(0))
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return True
    return data[data.rfind(b")") + 2:][:1] in (b"Z", b"X")


# ---- holders -------------------------------------------------------------------------------------

@dataclass
class Holder:
    proc: subprocess.Popen[bytes]
    token: str
    ready_path: str
    ignore_sigterm: bool
    pid: int = 0
    pidfd: int | None = None


class Bench:
    def __init__(self, args: argparse.Namespace, out: str) -> None:
        self.args = args
        self.out = out
        self.tmp = tempfile.mkdtemp(prefix="gpuclean-release-")
        self.sim_dir = ""
        if args.simulate:
            self.sim_dir = os.path.join(self.tmp, "sim")
            os.makedirs(os.path.join(self.sim_dir, "0"))
            self.backend: Any = SimulatedBackend(self.sim_dir)
        else:
            self.backend = NvmlBackend()
        self.device = self.backend.devices()[0]
        self.probe = Probe(self.backend, self.device)
        processes.set_child_subreaper()  # as the plugin does
        # The plugin's default settle time: a leak's latency is what a user's check pays.
        self.checker = Checker(self.backend, CheckSettings(grace=args.grace, settle=args.settle))
        self.holders: list[Holder] = []
        self.signals: list[tuple[float, int, int]] = []
        self.timelines: list[Timeline] = []
        self.results: dict[str, Any] = {"runs": {}}
        self.idle_bytes = 0
        self.tolerance_mib = 0
        self._wrap_signal()

    def _wrap_signal(self) -> None:
        # Instrumentation only: record when the checker's kill ladder sends each signal.
        original = processes.Handle.signal

        def recording(handle: Any, sig: int) -> bool:
            self.signals.append((time.monotonic(), handle.pid, sig))
            return original(handle, sig)

        processes.Handle.signal = recording  # type: ignore[method-assign]

    # -- holders --
    def start_holders(self, plan: list[bool]) -> None:
        ownership = self.checker.ownership
        env = dict(os.environ)
        env["PYTHONPATH"] = _common.REPO + os.pathsep + env.get("PYTHONPATH", "")
        if not self.args.simulate:
            env["CUDA_VISIBLE_DEVICES"] = self.device.uuid  # CUDA device 0 == the NVML device we watch
        log = open(os.path.join(self.out, "holders.log"), "ab")  # noqa: SIM115 - shared by the children
        for i, ignore in enumerate(plan):
            # Each holder belongs to its own test-like owner, protected (like a running fixture's
            # processes) until its test "ends", so the checker leaves the waiting ones alone.
            token = ownership.new_token(Owner("test", f"bench_release::holder{i}"))
            ownership.active_fixtures.add(token)
            env[COOKIE_VAR] = ownership.cookie(token)
            ready = os.path.join(self.tmp, f"ready{i}")
            cmd = [sys.executable, "-c", HOLDER, "sim" if self.args.simulate else "torch",
                   str(self.args.gib), "1" if ignore else "0", ready, self.sim_dir]
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=log, stderr=log)
            self.holders.append(Holder(proc, token, ready, ignore))
        log.close()

    def take_holder(self, ignore: bool) -> Holder:
        for h in self.holders:
            if h.ignore_sigterm == ignore and not h.pid and h.proc.poll() is None:
                return self._go(h)
        raise RuntimeError(f"no spare holder (ignore_sigterm={ignore}) left: all used or died "
                           "(see holders.log)")

    def _go(self, h: Holder) -> Holder:
        assert h.proc.stdin is not None
        h.proc.stdin.write(b"go\n")
        h.proc.stdin.flush()
        deadline = time.monotonic() + self.args.holder_timeout
        while not os.path.exists(h.ready_path):
            if h.proc.poll() is not None:
                raise RuntimeError(f"holder {h.proc.pid} died before allocating (rc {h.proc.returncode}); "
                                   f"see {self.out}/holders.log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"holder {h.proc.pid} not ready in {self.args.holder_timeout} s")
            time.sleep(0.01)
        h.pid = h.proc.pid
        try:
            h.pidfd = os.pidfd_open(h.pid)
        except (OSError, AttributeError):
            h.pidfd = None
        # Wait until the driver shows the allocation.
        deadline = time.monotonic() + 10
        while True:
            used, pids = self.probe.sample()
            if h.pid in pids and used >= self.idle_bytes + self.args.gib * 2**30 * 0.9:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"holder {h.pid} ready but NVML does not show its memory "
                                   f"(used {used / MIB:.0f} MiB, pids {sorted(pids)})")
            time.sleep(0.01)
        time.sleep(0.05)
        return h

    def finish_holder(self, h: Holder) -> None:
        if h.pidfd is not None:
            os.close(h.pidfd)
            h.pidfd = None
        with contextlib.suppress(Exception):
            h.proc.wait(timeout=5)

    def kill_all(self) -> None:
        for h in self.holders:
            with contextlib.suppress(ProcessLookupError, OSError):
                if h.proc.poll() is None:
                    h.proc.kill()
        for h in self.holders:
            with contextlib.suppress(Exception):
                h.proc.wait(timeout=10)

    # -- scenarios --
    def baseline(self) -> None:
        used, pids = self.probe.sample()
        self.idle_bytes = used
        result = self.checker.check("setup", (self.device,), tolerance_mib=0, timeout=0.5)
        if not result.clean:
            # Not our business to clean someone else's GPU: measure relative to what is there.
            self.tolerance_mib = int(used / MIB) + 64
            result = self.checker.check("setup", (self.device,), tolerance_mib=self.tolerance_mib,
                                        timeout=0.5)
        self.results["baseline"] = {"idle_used_mib": used / MIB,
                                    "idle_used_v1_mib": self.probe.used_v1()[0] / MIB,
                                    "pids_listed": sorted(pids),
                                    "tolerance_mib": self.tolerance_mib, "clean": result.clean}
        if not result.clean:
            raise RuntimeError(f"GPU is not clean before we start: {result.offenders}")

    def run_driver(self, run: int) -> dict[str, Any]:
        h = self.take_holder(ignore=False)
        tl = Timeline("driver", run, time.monotonic())
        # Poll NVML every ~1 ms from this thread (no sampler): the driver's own release time.
        for _ in range(20):
            self._record(tl, h)
            time.sleep(0.001)
        t_sig = time.monotonic()
        os.kill(h.pid, signal.SIGTERM)
        tl.mark("SIGTERM", t_sig)
        exited = gone = idle = None
        deadline = t_sig + 15
        while time.monotonic() < deadline:
            now, used, listed = self._record(tl, h)
            if exited is None and _exited(h.pid, h.pidfd):
                exited = now
                tl.mark("exited", now)
            if gone is None and not listed:
                gone = now
                tl.mark("gone from NVML", now)
            if idle is None and used <= self.idle_bytes + self.tolerance_mib * MIB:
                idle = now
                tl.mark("memory back to idle", now)
            if exited and gone and idle and now - max(gone, idle) > 0.05:
                break
            time.sleep(0.001)
        self.timelines.append(tl)
        self.finish_holder(h)
        if exited is None or gone is None or idle is None:
            raise RuntimeError("driver scenario: the holder did not exit and release within 15 s")
        released = max(gone, idle)
        return {"signal_to_exit_s": exited - t_sig, "exit_to_release_s": released - exited,
                "signal_to_gone_s": gone - t_sig, "signal_to_idle_s": idle - t_sig,
                "release_s": released - t_sig, "samples": len(tl.samples),
                "mean_sample_interval_ms": _mean_interval(tl)}

    def _record(self, tl: Timeline, h: Holder) -> tuple[float, int, bool]:
        used, pids = self.probe.sample()
        now = time.monotonic()
        listed = h.pid in pids
        tl.samples.append(((now - tl.t0) * 1e3, used / MIB, listed))
        return now, used, listed

    def run_reap(self, run: int, ignore: bool) -> dict[str, Any]:
        h = self.take_holder(ignore=ignore)
        name = "reap_ignore" if ignore else "reap_term"
        tl = Timeline(name, run, time.monotonic())
        sampler = Sampler(self.probe, tl, h.pid, h.pidfd, self.args.sample_ms / 1e3,
                          self.idle_bytes + self.tolerance_mib * MIB)
        sampler.start()
        time.sleep(0.03)
        # The test is over: its processes are no longer protected; the teardown check starts.
        self.checker.ownership.active_fixtures.discard(h.token)
        self.signals.clear()
        t0 = time.monotonic()
        tl.mark("teardown check starts", t0)
        result = self.checker.check("teardown", (self.device,), tolerance_mib=self.tolerance_mib,
                                    timeout=30.0)
        t1 = time.monotonic()
        tl.mark("verdict: clean" if result.clean else "verdict: NOT clean", t1)
        time.sleep(0.05)
        sampler.stop()
        for at, pid, sig in self.signals:
            if pid == h.pid:
                tl.mark(signal.Signals(sig).name, at)
        self.timelines.append(tl)
        self.finish_holder(h)
        sigs = {signal.Signals(sig).name: at - t0 for at, pid, sig in self.signals if pid == h.pid}
        reaped = [r for r in result.reaped if r.process.pid == h.pid]
        last_signal = max((at for at, pid, _ in self.signals if pid == h.pid), default=t0)
        release_end = max(x for x in (sampler.gone_at, sampler.idle_at) if x is not None) \
            if sampler.gone_at and sampler.idle_at else None
        return {
            "latency_s": t1 - t0, "clean": result.clean, "grace_s": self.args.grace,
            "signals_s": sigs,
            "exited_s": (sampler.exited_at - t0) if sampler.exited_at else None,
            "released_s": (release_end - t0) if release_end else None,
            "last_signal_to_release_s": (release_end - last_signal) if release_end else None,
            "verdict_after_release_ms": ((t1 - release_end) * 1e3) if release_end else None,
            "first_signal_ms": min(sigs.values()) * 1e3 if sigs else None,
            "checker_exit_s": reaped[0].exit_s if reaped else None,
            "checker_release_s": reaped[0].release_s if reaped else None,
            "ended_by": reaped[0].ended_by if reaped else None,
            "offenders": [o.detail for o in result.offenders], "notes": list(result.notes),
            "mean_sample_interval_ms": _mean_interval(tl),
        }

    def run_vllm(self, run: int) -> dict[str, Any]:
        h = self.take_holder(ignore=False)
        tl = Timeline("vllm", run, time.monotonic())
        sampler = Sampler(self.probe, tl, h.pid, h.pidfd, self.args.sample_ms / 1e3 * 5,
                          self.idle_bytes + self.tolerance_mib * MIB)
        sampler.start()
        time.sleep(0.03)
        t0 = time.monotonic()
        tl.mark("teardown starts", t0)
        os.kill(h.pid, signal.SIGTERM)  # the test's own cleanup: the best case for vLLM
        tl.mark("SIGTERM", time.monotonic())
        polls: list[float] = []

        def on_poll(raw: dict[int, tuple[float, float]]) -> None:
            now = time.monotonic()
            polls.append(now - t0)
            tl.mark(f"vLLM poll: {raw[0][0]:.2f} GiB", now)

        # v1 memory, as vLLM reads it (an idle H200 shows ~615 MiB there). Threshold: idle + 2 GiB
        # (vLLM's tests pass fixed thresholds of this order), at most half the holder's allocation.
        idle_v1 = float(self.results["baseline"]["idle_used_v1_mib"])
        threshold = int(idle_v1 * MIB + min(2.0, self.args.gib / 2) * 2**30)
        _common.vllm_style_wait(lambda _i: self.probe.used_v1(), [0], threshold, io.StringIO(),
                                on_poll=on_poll)
        t1 = time.monotonic()
        tl.mark("vLLM: clean", t1)
        time.sleep(0.05)
        sampler.stop()
        self.timelines.append(tl)
        self.finish_holder(h)
        return {"latency_s": t1 - t0, "polls_s": polls, "threshold_mib": threshold / MIB,
                "released_s": (max(sampler.gone_at, sampler.idle_at) - t0)
                if sampler.gone_at and sampler.idle_at else None}

    def save(self) -> None:
        self.results["signals_wrapped"] = True
        _common.write_json(os.path.join(self.out, "release_results.json"), self.results)
        _common.write_json(os.path.join(self.out, "release_timeline.json"),
                           {"machine": self.results.get("machine"), "gib": self.args.gib,
                            "grace_s": self.args.grace, "timelines": [t.to_json() for t in self.timelines]})


def _mean_interval(tl: Timeline) -> float:
    times = [s[0] for s in tl.samples]
    if len(times) < 2:
        return float("nan")
    return (times[-1] - times[0]) / (len(times) - 1)


def summarize(results: dict[str, Any], grace: float) -> dict[str, Any]:
    runs = results["runs"]
    out: dict[str, Any] = {}

    def med(name: str, key: str) -> float | None:
        values = [r[key] for r in runs.get(name, []) if r.get(key) is not None]
        return statistics.median(values) if values else None

    driver = med("driver", "release_s")
    term = med("reap_term", "latency_s")
    ignore = med("reap_ignore", "latency_s")
    vllm = med("vllm", "latency_s")
    out["driver_release_s"] = driver
    out["driver_signal_to_exit_s"] = med("driver", "signal_to_exit_s")
    out["reap_term_latency_s"] = term
    out["reap_ignore_latency_s"] = ignore
    out["vllm_latency_s"] = vllm
    if driver is not None and term is not None:
        worst = max(r["latency_s"] for r in runs["reap_term"])
        out["reap_term_over_driver_ms"] = (term - driver) * 1e3
        out["reap_term_worst_over_driver_ms"] = (worst - driver) * 1e3
        out["target_a_met"] = worst - driver <= 0.050
    if ignore is not None:
        worst = max(r["latency_s"] for r in runs["reap_ignore"])
        out["reap_ignore_over_grace_ms"] = (ignore - grace) * 1e3
        out["reap_ignore_worst_over_grace_ms"] = (worst - grace) * 1e3
        out["target_b_met"] = worst <= grace + 0.2
    if vllm is not None and term is not None:
        out["vllm_over_reap_term_ratio"] = vllm / term
    # gpuclean's own part of the latency: before its first signal, and from release to verdict.
    for name in ("reap_term", "reap_ignore"):
        out[f"{name}_first_signal_ms"] = med(name, "first_signal_ms")
        out[f"{name}_verdict_after_release_ms"] = med(name, "verdict_after_release_ms")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for results (the lead passes $OUT)")
    parser.add_argument("--simulate", action="store_true", help="no GPU: simulated device and holders")
    parser.add_argument("--gib", type=float, default=4.0, help="GiB each holder allocates (default 4)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of driver/reap_term/reap_ignore (default 3)")
    parser.add_argument("--vllm-repeat", type=int, default=1, help="runs of the vllm scenario (5 s each)")
    parser.add_argument("--grace", type=float, default=1.0, help="SIGTERM->SIGKILL grace (default 1 s)")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="settle time before reaping (default 1 s, the plugin's default)")
    parser.add_argument("--sample-ms", type=float, default=2.0,
                        help="timeline sampling period (default 2 ms)")
    parser.add_argument("--holder-timeout", type=float, default=90.0)
    parser.add_argument("--import-modules", default="",
                        help="comma-separated modules to import into this (the 'pytest') process first, "
                             "e.g. torch,transformers: a realistic heap (CUDA is not initialised here)")
    args = parser.parse_args()
    heap: dict[str, Any] = {}
    if args.import_modules:
        import gc
        import importlib

        t = time.monotonic()
        for name in args.import_modules.split(","):
            try:
                importlib.import_module(name.strip())
                heap.setdefault("imported", []).append(name.strip())
            except Exception as exc:  # a missing module only makes the heap smaller: say so
                heap.setdefault("failed", []).append(f"{name.strip()}: {type(exc).__name__}: {exc}"[:200])
        heap["import_s"] = time.monotonic() - t
        heap["gc_objects"] = len(gc.get_objects())
        print(f"imported {heap.get('imported')} (failed: {heap.get('failed')}): "
              f"{heap['gc_objects']} objects in this process's heap", flush=True)
    os.makedirs(args.out, exist_ok=True)
    # The sampler thread must get the GIL every ~0.5 ms, not every 5 ms (Python's default switch
    # interval), or the timeline has holes while the checker computes.
    sys.setswitchinterval(0.0005)
    started = time.monotonic()
    bench = Bench(args, args.out)
    info = _common.machine()
    info["backend"] = bench.backend.kind
    info["driver"] = bench.backend.driver_version()
    info["device"] = f"{bench.device.label}: {bench.device.name} ({bench.device.uuid})"
    bench.results["machine"] = info
    bench.results["package"] = PACKAGE
    bench.results["config"] = {"gib": args.gib, "grace_s": args.grace, "repeat": args.repeat,
                               "vllm_repeat": args.vllm_repeat, "sample_ms": args.sample_ms,
                               "import_modules": args.import_modules}
    import gc

    heap.setdefault("gc_objects", len(gc.get_objects()))
    bench.results["heap"] = heap
    print(f"release benchmark on {info['device']}, driver {info['driver']}, {info['date_utc']}", flush=True)
    rc = 0
    try:
        bench.baseline()
        plan = [False] * (2 * args.repeat + args.vllm_repeat) + [True] * args.repeat
        bench.start_holders(plan)
        order: list[tuple[str, Callable[[int], dict[str, Any]]]] = []
        for _r in range(args.repeat):
            order += [("driver", bench.run_driver), ("reap_term", lambda i: bench.run_reap(i, False)),
                      ("reap_ignore", lambda i: bench.run_reap(i, True))]
        order += [("vllm", bench.run_vllm)] * args.vllm_repeat
        counters: dict[str, int] = {}
        for name, fn in order:
            i = counters.get(name, 0)
            counters[name] = i + 1
            res = fn(i)
            bench.results["runs"].setdefault(name, []).append(res)
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()
                     if k in ("release_s", "signal_to_exit_s", "latency_s", "released_s", "ended_by", "clean",
                              "first_signal_ms", "verdict_after_release_ms", "mean_sample_interval_ms")}
            print(f"  {name:11s} #{i + 1}: {shown}", flush=True)
            bench.save()
    except Exception:
        traceback.print_exc()
        bench.results["error"] = traceback.format_exc()
        rc = 1
    finally:
        bench.kill_all()
        bench.results["summary"] = summarize(bench.results, args.grace)
        bench.results["total_s"] = time.monotonic() - started
        bench.save()
    s = bench.results["summary"]
    print(json.dumps(s, indent=2))

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 1e3:.0f} ms"

    print(f"driver release {ms(s.get('driver_release_s'))}; gpuclean (a) {ms(s.get('reap_term_latency_s'))} "
          f"(target: <= driver + 50 ms: {s.get('target_a_met')}); (b) {ms(s.get('reap_ignore_latency_s'))} "
          f"(target: <= grace {args.grace} s + 0.2 s: {s.get('target_b_met')}); vLLM-style "
          f"{ms(s.get('vllm_latency_s'))}; total {bench.results['total_s']:.0f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())

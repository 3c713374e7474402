"""Benchmark 1: clean-path overhead per checked test, gpuclean vs the shell check vs a vLLM-style check.

One checked test costs gpuclean a setup and a teardown check: 2x ``Checker.check(...)`` on clean devices,
with the GPU health watch's Xid drain before and after (issue 28; absent in a tree from before it), plus,
with locking on, acquiring and releasing the per-GPU locks. It is measured side by side with:

* ``shell``: the seeds' manual check, ``ps aux | grep python3 | grep -v grep; nvidia-smi
  --query-gpu=index,memory.used --format=csv,noheader``, run twice per test (before and after) through
  ``subprocess.run(..., shell=True)``. Without ``nvidia-smi`` on the machine (the CPU box), only the
  ``ps`` half runs: a lower bound (on the H200 the whole command, ``ps`` and ``nvidia-smi``, cost 58.8 ms per
  test: benchmarks/README.md).
* ``vllm``: our own equivalent of vLLM's ``tests/utils.py::wait_for_gpu_memory_to_clear`` (NVML v1
  used memory of each device against a byte threshold, printing a line per poll, polling every 5 s until
  clean; ``nvmlInit``/``nvmlShutdown`` around every call, as vLLM's ``@_nvml()`` decorator does). It runs
  in a worker process of its own, so NVML is really initialised per call as in vLLM's test process. With
  simulated devices the "init" is opening the simulated backend and a device read is the simulated
  backend's memory total (there is no NVML on the CPU box).

Methods are interleaved in rounds (rotating order), and medians over rounds are reported with ratios to
gpuclean. ``--real`` uses NVML; a machine with fewer GPUs than asked for checks its GPUs repeatedly
(``8`` on a one-GPU box = GPU 0 eight times), which costs what 8 GPUs would (NVML calls per device).

    python benchmarks/bench_clean_path.py                 # simulated devices (CPU)
    python benchmarks/bench_clean_path.py --real --json $OUT/clean_path_real.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common
import _layers_compat  # noqa: F401  # (a tree from before the layers: issue 29)
from _checked import checked_test, health_watch

from pytest_gpuclean._check.checker import Checker
from pytest_gpuclean._locks.gpus import GpuLocks
from pytest_gpuclean._model.records import DeviceInfo
from pytest_gpuclean._reading.nvml import NvmlBackend
from pytest_gpuclean._reading.simulated import SimulatedBackend

SHELL_FULL = ("ps aux | grep python3 | grep -v grep; "
              "nvidia-smi --query-gpu=index,memory.used --format=csv,noheader")
SHELL_PS_ONLY = "ps aux | grep python3 | grep -v grep"


# ---- the vLLM-style check (our own code, in _common.vllm_style_wait) ----------------------------

def _vllm_call_nvml(devices: list[int], threshold: int, out: io.StringIO) -> None:
    import pynvml

    pynvml.nvmlInit()  # vLLM's @_nvml() decorator: init and shutdown around every call
    try:
        def read(index: int) -> tuple[int, int]:
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))  # v1
            return int(info.used), int(info.total)

        _common.vllm_style_wait(read, devices, threshold, out)
    finally:
        pynvml.nvmlShutdown()


def _vllm_call_sim(root: str, devices: list[int], threshold: int, out: io.StringIO) -> None:
    backend = SimulatedBackend(root)  # the analogue of nvmlInit per call
    by_index = {d.index: d for d in backend.devices()}

    def read(index: int) -> tuple[int, int]:
        snap = backend.snapshot(by_index[index])
        return snap.used_bytes, snap.total_bytes

    _common.vllm_style_wait(read, devices, threshold, out)


def vllm_worker(args: argparse.Namespace) -> int:
    """Serve timing requests ``<n> <reps>`` on stdin; answer seconds per test (2 calls) as JSON."""
    physical = max(1, args.physical)
    threshold = 2 * 2**30 if args.real else 0  # v1 counts ~615 MiB reserved as used on an idle H200
    for line in sys.stdin:
        n, reps = (int(x) for x in line.split())
        devices = [i % physical for i in range(n)]
        out = io.StringIO()
        if args.real:
            def call(devices: list[int] = devices, out: io.StringIO = out) -> None:
                _vllm_call_nvml(devices, threshold, out)
        else:
            def call(devices: list[int] = devices, out: io.StringIO = out) -> None:
                _vllm_call_sim(args.simulate, devices, threshold, out)
        started = time.perf_counter()
        for _ in range(reps):
            call()  # before the test
            call()  # after the test
            out.seek(0)
            out.truncate()
        elapsed = time.perf_counter() - started
        print(json.dumps({"per_test_s": elapsed / reps}), flush=True)
    return 0


class VllmWorker:
    def __init__(self, real: bool, simulate: str | None, physical: int) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--vllm-worker", "--physical", str(physical)]
        cmd += ["--real"] if real else ["--simulate", str(simulate)]
        env = dict(os.environ)
        env["PYTHONPATH"] = _common.REPO + os.pathsep + env.get("PYTHONPATH", "")
        # Started through a fork whose parent exits at once: the worker is then no descendant of this
        # process, so the checker under test neither sees it (census cost) nor reaps it as a leak.
        launcher = [sys.executable, "-c", "import os, sys\nif os.fork():\n    os._exit(0)\n"
                    "os.execv(sys.argv[1], sys.argv[1:])", *cmd]
        self.proc = subprocess.Popen(launcher, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        self.proc.wait()  # the launcher; the worker keeps its end of the pipes

    def per_test(self, n: int, reps: int) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{n} {reps}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("vLLM-style worker died")
        return float(json.loads(line)["per_test_s"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the worker exits at end of input


# ---- the benchmark ---------------------------------------------------------------------------

def _time_block(fn: Callable[[], object], reps: int) -> float:
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps


def nvml_micro(backend: Any, device: DeviceInfo, reps: int = 2000) -> dict[str, float]:
    """Seconds per NVML call on one device (what each simulated device stands in for)."""
    import pynvml

    handle = backend._handles[device.uuid]
    calls: dict[str, Callable[[], object]] = {
        "memory_info_v2": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2),
        "memory_info_v1": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle),
        "compute_processes": lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle),
        "graphics_processes": lambda: pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle),
        "backend_snapshot": lambda: backend.snapshot(device),
    }
    result = {}
    for name, fn in calls.items():
        _time_block(fn, 50)
        result[name] = min(_time_block(fn, reps // 5) for _ in range(5))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--real", action="store_true", help="real GPUs through NVML (default: simulated)")
    parser.add_argument("--devices", default="1,8", help="device counts to measure (default 1,8)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    parser.add_argument("--reps", type=int, default=200,
                        help="checked tests per round for in-process methods")
    parser.add_argument("--shell-reps", type=int, default=3,
                        help="checked tests per round for the shell check")
    parser.add_argument("--json",
                        help="write results here (default benchmarks/results/clean_path_<mode>.json)")
    parser.add_argument("--no-own-context", action="store_true",
                        help="skip the extra scenario where this process holds a CUDA context")
    parser.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--simulate", help=argparse.SUPPRESS)
    parser.add_argument("--physical", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_worker:
        return vllm_worker(args)

    counts = [int(x) for x in args.devices.split(",")]
    mode = "real" if args.real else "simulated"
    tmp = tempfile.mkdtemp(prefix="gpuclean-bench-")
    # No child subreaper here (the plugin sets one): it changes nothing on the clean path, and without
    # it the vLLM-style worker (double-forked) stays out of this process's tree.
    sim_root = None
    if args.real:
        backend: Any = NvmlBackend()
    else:
        sim_root = os.path.join(tmp, "devices")
        for i in range(max(counts)):
            os.makedirs(os.path.join(sim_root, str(i)))
        backend = SimulatedBackend(sim_root)
    physical = list(backend.devices())
    if not physical:
        print("no devices found", file=sys.stderr)
        return 2
    checker = Checker(backend)
    watch = health_watch(backend, physical)
    locks = GpuLocks(os.path.join(tmp, "locks"))
    has_smi = shutil.which("nvidia-smi") is not None
    shell_cmd = SHELL_FULL if has_smi else SHELL_PS_ONLY
    worker = VllmWorker(args.real, sim_root, len(physical))

    info = _common.machine()
    info["backend"] = mode
    info["driver"] = backend.driver_version()
    info["physical_devices"] = [f"{d.label}: {d.name}" for d in physical]
    results: dict[str, Any] = {"machine": info, "mode": mode, "shell_command": shell_cmd,
                               "shell_is_stand_in": not has_smi, "rounds": args.rounds, "by_devices": {}}
    print(f"clean-path benchmark, {mode} devices, {info['date_utc']}, {info['host']} ({info['cpus']} CPUs)")
    if not has_smi:
        print("note: no nvidia-smi here; the shell check runs only its 'ps aux | grep python3' half "
              "(a lower bound: with nvidia-smi, 58.8 ms per test on the H200)")

    for n in counts:
        devs = tuple(physical[i % len(physical)] for i in range(n))
        lock_uuids = [f"{d.uuid}-bench{i}" for i, d in enumerate(devs)]  # distinct lock files per slot
        first = checker.check("setup", devs, tolerance_mib=0, timeout=1.0)
        if not first.clean:
            print(f"devices are not clean, cannot measure the clean path: {first.offenders}", file=sys.stderr)
            return 3

        def gpuclean(devs: tuple[DeviceInfo, ...] = devs) -> None:
            checked_test(checker, watch, devs)

        def gpuclean_locks(devs: tuple[DeviceInfo, ...] = devs, uuids: list[str] = lock_uuids) -> None:
            checked_test(checker, watch, devs, locks, uuids)

        def snapshots(devs: tuple[DeviceInfo, ...] = devs) -> None:
            checker.snapshot(devs)
            checker.snapshot(devs)

        def census() -> None:
            checker.census()
            checker.census()

        def shell() -> None:
            for _ in range(2):
                subprocess.run(shell_cmd, shell=True, capture_output=True)

        methods: dict[str, Callable[[], float]] = {
            "gpuclean": lambda: _time_block(gpuclean, args.reps),
            "gpuclean+locks": lambda: _time_block(gpuclean_locks, args.reps),
            "  of which device reads": lambda: _time_block(snapshots, args.reps),
            "  of which process census": lambda: _time_block(census, args.reps),
            "vllm-style": lambda n=n: worker.per_test(n, max(1, args.reps // (20 if args.real else 4))),
            "shell": lambda: _time_block(shell, args.shell_reps),
        }
        for fn in methods.values():  # warm-up
            fn()
        samples: dict[str, list[float]] = {name: [] for name in methods}
        names = list(methods)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                samples[name].append(methods[name]())
        stats = {name: _common.summary(v) for name, v in samples.items()}
        base = stats["gpuclean"]["median"]
        per_round_ratio = {
            name: _common.summary([a / b for a, b in zip(v, samples["gpuclean"], strict=True)])["median"]
                           for name, v in samples.items()}
        results["by_devices"][str(n)] = {
            "devices": [d.label for d in devs], "replicated": len(physical) < n,
            "per_test_s": stats,
            "ratio_to_gpuclean": {name: s["median"] / base for name, s in stats.items()},
            "median_of_per_round_ratios": per_round_ratio,
        }
        rows = [[name, _common.fmt_time(s["median"]), _common.fmt_time(s["p10"]), _common.fmt_time(s["p90"]),
                 f"{s['median'] / base:.2f}x"] for name, s in stats.items()]
        note = f" (GPU 0 checked {n} times)" if len(physical) < n else ""
        print(f"\n{n} device(s){note}: per checked test (2 checks), median of {args.rounds} rounds")
        print(_common.table(rows, ["method", "median", "p10", "p90", "vs gpuclean"]))

    if args.real:
        results["nvml_call_s"] = nvml_micro(backend, physical[0])
        print("\nNVML calls on " + physical[0].label + ": " + ", ".join(
            f"{k} {_common.fmt_time(v)}" for k, v in results["nvml_call_s"].items()))
    if not args.no_own_context:
        clean = {n: r["per_test_s"]["gpuclean"]["median"] for n, r in results["by_devices"].items()}
        results["own_context"] = own_context_scenario(checker, physical, counts, args, sim_root, clean)
    worker.close()
    target_n = "8" if "8" in results["by_devices"] else str(counts[-1])
    res = results["by_devices"][target_n]
    results["target"] = {
        "devices": int(target_n),
        "gpuclean_per_test_s": res["per_test_s"]["gpuclean"]["median"],
        "gpuclean_locks_per_test_s": res["per_test_s"]["gpuclean+locks"]["median"],
        "limit_s": 0.3e-3,
        "met": res["per_test_s"]["gpuclean"]["median"] <= 0.3e-3,
        "met_with_locks": res["per_test_s"]["gpuclean+locks"]["median"] <= 0.3e-3,
        "shell_ratio": res["ratio_to_gpuclean"]["shell"],
    }
    target = results["target"]
    print(f"\ntarget (<= 0.3 ms per checked test on {target_n} devices): gpuclean "
          f"{_common.fmt_time(target['gpuclean_per_test_s'])} -> {'met' if target['met'] else 'MISSED'}, "
          f"with locks {_common.fmt_time(target['gpuclean_locks_per_test_s'])} -> "
          f"{'met' if target['met_with_locks'] else 'MISSED'}; shell check / gpuclean = "
          f"{target['shell_ratio']:.0f}x")
    path = args.json or os.path.join(_common.REPO, "benchmarks", "results", f"clean_path_{mode}.json")
    _common.write_json(path, results)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def own_context_scenario(checker: Checker, physical: list[DeviceInfo], counts: list[int],
                         args: argparse.Namespace, sim_root: str | None,
                         clean: dict[str, float]) -> dict[str, Any]:
    """gpuclean again while this process holds a CUDA context (tests using torch in-process).

    Simulated: this process "holds" 612 MiB on every device plus 9 MiB of context overhead charged to
    no process (the figures of a context with a 4-byte tensor on the H200).
    """
    if sim_root is not None:
        from pytest_gpuclean.simulate import allocate

        for d in physical:
            allocate(sim_root, d.index, 612)
            with open(os.path.join(sim_root, str(d.index), "context_overhead"), "w") as f:
                f.write(str(9 * 2**20))
    else:
        try:
            import torch
        except ImportError:
            return {"skipped": "torch not importable"}
        with contextlib.suppress(Exception):
            torch.zeros(1, device="cuda")
        if not torch.cuda.is_initialized():
            return {"skipped": "CUDA could not be initialised"}
    out: dict[str, Any] = {}
    # A context with a 4-byte tensor: does NVML v2 count it as used, and list the process?
    snap = checker.snapshot(physical[:1])[0]
    out["context_only"] = {"used_mib": snap.used_bytes / 2**20, "me": os.getpid(),
                           "listed": [(p.pid, (p.used_bytes or 0) / 2**20) for p in snap.processes]}
    print(f"\nthis process now holds a CUDA context: device used {snap.used_bytes / 2**20:.0f} MiB, "
          f"listed {out['context_only']['listed']} (me: {os.getpid()}); its memory is excused:")
    for n in counts:
        devs = tuple(physical[i % len(physical)] for i in range(n))
        result = checker.check("setup", devs, tolerance_mib=0, timeout=1.0)

        def gpuclean(devs: tuple[DeviceInfo, ...] = devs) -> None:
            checker.check("setup", devs, tolerance_mib=0, timeout=60.0)
            checker.check("teardown", devs, tolerance_mib=0, timeout=60.0)

        _time_block(gpuclean, 20)
        values = [_time_block(gpuclean, args.reps) for _ in range(args.rounds)]
        s = _common.summary(values)
        ratio = s["median"] / clean[str(n)] if str(n) in clean else float("nan")
        out[str(n)] = {"per_test_s": s, "clean": result.clean, "self_mib": result.self_mib,
                       "ratio_to_clean_devices": ratio}
        print(f"  {n} device(s): gpuclean {_common.fmt_time(s['median'])} per checked test, "
              f"{ratio:.1f}x the idle-device figure above (verdict clean={result.clean}, "
              f"own context {result.self_mib[:1]})")
    return out


if __name__ == "__main__":
    sys.exit(main())

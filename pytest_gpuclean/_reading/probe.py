"""The CUDA sanity probe: a subprocess that, within a deadline, writes and reads 1 MiB on each device
through the CUDA driver API (ctypes, no torch). A subprocess, because a context would stay in the pytest
process (memory on every GPU, and broken forks), and a sick GPU can hang a CUDA call: the deadline kills
the probe, never the session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

from pytest_gpuclean._model.records import DeviceInfo
from pytest_gpuclean._reading import simulated_layout as layout

PROBE_BYTES = 1 << 20

# The child's first line names the simulated devices' files that it reads (their layout's one home).
_NAMES = f"LOST, PROBE_FAILS, PROBE_HANGS = {layout.LOST!r}, {layout.PROBE_FAILS!r}, {layout.PROBE_HANGS!r}\n"
_SCRIPT = _NAMES + r"""
import ctypes, json, os, sys, time

def report(uuid, error, started):
    print(json.dumps({"uuid": uuid, "error": error, "seconds": round(time.monotonic() - started, 6)}),
          flush=True)

def simulated(root, pairs):
    for pair in pairs:
        index, uuid = pair.split(":", 1)
        started = time.monotonic()
        folder = os.path.join(root, index)
        if os.path.exists(os.path.join(folder, PROBE_HANGS)):
            while True:
                time.sleep(3600)
        error = None
        if not os.path.isdir(folder) or os.path.exists(os.path.join(folder, LOST)):
            error = "cuInit returned 101 (CUDA_ERROR_INVALID_DEVICE): the device is gone"
        elif os.path.exists(os.path.join(folder, PROBE_FAILS)):
            with open(os.path.join(folder, PROBE_FAILS)) as f:
                error = f.read().strip() or "the simulated probe failed"
        report(uuid, error, started)

def cuda(uuids, size):
    lib = ctypes.CDLL("libcuda.so.1")

    def call(what, code):
        if code != 0:
            text = ctypes.c_char_p()
            lib.cuGetErrorName(code, ctypes.byref(text))
            raise RuntimeError(f"{what} returned {code} ({(text.value or b'?').decode()})")

    started = time.monotonic()
    count = ctypes.c_int()
    try:
        call("cuInit", lib.cuInit(0))
        call("cuDeviceGetCount", lib.cuDeviceGetCount(ctypes.byref(count)))
    except RuntimeError as exc:
        for uuid in uuids:
            report(uuid, str(exc), started)
        return
    # CUDA_VISIBLE_DEVICES lists the UUIDs in this order; a GPU's own UUID confirms its ordinal.
    ordinals = {}
    for ordinal in range(count.value):
        dev, raw = ctypes.c_int(), (ctypes.c_ubyte * 16)()
        if lib.cuDeviceGet(ctypes.byref(dev), ordinal) == 0 and lib.cuDeviceGetUuid(raw, dev) == 0:
            h = bytes(raw).hex()
            ordinals[f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}".lower()] = ordinal
    pattern = bytes(range(256)) * (size // 256)
    for position, uuid in enumerate(uuids):
        started = time.monotonic()
        ordinal = ordinals.get(uuid.lower(), position if position < count.value else None)
        ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
        error = None
        try:
            if ordinal is None:
                raise RuntimeError("not visible to CUDA")
            dev = ctypes.c_int()
            call("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), ordinal))
            call("cuCtxCreate", lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev))
            call("cuMemAlloc", lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)))
            call("cuMemcpyHtoD", lib.cuMemcpyHtoD_v2(ptr, pattern, ctypes.c_size_t(size)))
            back = ctypes.create_string_buffer(size)
            call("cuMemcpyDtoH", lib.cuMemcpyDtoH_v2(back, ptr, ctypes.c_size_t(size)))
            call("cuCtxSynchronize", lib.cuCtxSynchronize())
            if back.raw != pattern:
                raise RuntimeError("read back other bytes than it wrote")
        except RuntimeError as exc:
            error = str(exc)
        finally:
            if ptr.value:
                lib.cuMemFree_v2(ptr)
            if ctx.value:
                lib.cuCtxDestroy_v2(ctx)
        report(uuid, error, started)

if sys.argv[1] == "sim":
    simulated(sys.argv[2], sys.argv[3:])
else:
    cuda(sys.argv[3:], int(sys.argv[2]))
"""


def run(devices: Sequence[DeviceInfo], *, simulate: str | None, timeout: float) -> dict[str, str | None]:
    """Probe ``devices``; per UUID, None if it passed, else the error. Never raises for a failing device."""
    if not devices:
        return {}
    env = dict(os.environ)
    if simulate:
        args = ["sim", simulate, *(f"{d.index}:{d.uuid}" for d in devices)]
    else:
        # The probe sees exactly the devices it probes (MIG instances are visible only this way).
        env["CUDA_VISIBLE_DEVICES"] = ",".join(d.uuid for d in devices)
        args = ["cuda", str(PROBE_BYTES), *(d.uuid for d in devices)]
    try:
        proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
    except OSError as exc:
        return {d.uuid: f"could not start the probe: {exc}" for d in devices}
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Our own child, not yet waited for: its pid cannot have been reused.
        timed_out = True
        proc.kill()
        out, err = proc.communicate()
    results: dict[str, str | None] = {}
    for line in out.splitlines():
        try:
            answer = json.loads(line)
            results[str(answer["uuid"])] = None if answer["error"] is None else str(answer["error"])
        except (ValueError, KeyError, TypeError):
            continue
    last = (err.strip().splitlines() or [""])[-1]
    for device in devices:
        if device.uuid not in results:
            results[device.uuid] = (f"no answer within the {timeout:g}s deadline (the probe was killed)"
                                    if timed_out else f"the probe exited with status {proc.returncode}"
                                    + (f": {last[:200]}" if last else ""))
    return results

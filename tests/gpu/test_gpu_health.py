"""GPU health on a real GPU (issue 28): a kernel that stores through a null pointer makes the driver log
Xid 31, which gpuclean names and blames on the test whose kernel did it (in its own process and in a child
process), and the next test passes on the same GPU. No GPU is reset and no setting is changed here.

The kernel is PTX loaded through the CUDA driver API with ctypes (no torch). Tried on the H200 (driver
580.159.04) before this test was written: ``cuCtxSynchronize`` returns 700 (CUDA_ERROR_ILLEGAL_ADDRESS) in
the process that launched it, and an NVML event set delivers Xid 31 within a millisecond; this test's own
run there is in benchmarks/GPU-RUNS.md.

"Its own test" runs the kernel in the inner pytest process itself: that process's context keeps the
sticky error (CUDA cannot be used in it again), which is why the inner session is a process of its own
and why its later tests use CUDA only in child processes (the child case, and the probe of the next test).
Figures are printed so benchmarks/GPU-RUNS.md can quote them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FAULT = r'''
import ctypes

PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry null_store()
{
    .reg .b64 %rd<2>;
    .reg .b32 %r<2>;
    mov.u64 %rd1, 0;
    mov.u32 %r1, 42;
    st.global.u32 [%rd1], %r1;
    ret;
}
"""


def fault():
    """Launch the null store on CUDA device 0; return what cuCtxSynchronize says (700 expected)."""
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(what, code):
        if code:
            raise RuntimeError(f"{what} returned {code}")

    check("cuInit", cuda.cuInit(0))
    dev, ctx, module, function = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    check("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(dev), 0))
    check("cuCtxCreate", cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev))
    check("cuModuleLoadData", cuda.cuModuleLoadData(ctypes.byref(module), PTX))
    check("cuModuleGetFunction", cuda.cuModuleGetFunction(ctypes.byref(function), module, b"null_store"))
    check("cuLaunchKernel", cuda.cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, None, None, None))
    return cuda.cuCtxSynchronize()


if __name__ == "__main__":
    print(fault())
'''

# FAULT_SOURCE becomes FAULT as a Python string literal.
INNER = '''
import subprocess, sys
import pytest
from pytest_gpuclean._reading import probe
from pytest_gpuclean._model.records import DeviceInfo
FAULT = FAULT_SOURCE
exec(FAULT.replace('if __name__ == "__main__":', "if False:"))


@pytest.mark.needs_clean_gpus
def test_child_kernel_faults():
    # The test sees only its child's exit: the fault is gpuclean's to name.
    out = subprocess.run([sys.executable, "-c", FAULT], capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-1] == "700", out.stderr


@pytest.mark.needs_clean_gpus
def test_own_kernel_faults():
    assert fault() == 700  # CUDA_ERROR_ILLEGAL_ADDRESS, in this (inner pytest) process


@pytest.mark.needs_clean_gpus
def test_next_passes(clean_gpus):
    # A fresh process on the same GPU: context, 1 MiB allocated, written and read back.
    devices = [DeviceInfo(d.index, d.uuid, d.name) for d in clean_gpus.devices]
    assert probe.run(devices, simulate=None, timeout=120) == {d.uuid: None for d in devices}
'''.replace("FAULT_SOURCE", repr(FAULT))


def test_xid_31_is_named_and_blamed_in_its_own_test_and_from_a_child(pytester: pytest.Pytester,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GPUCLEAN_SIMULATE", "CUDA_VISIBLE_DEVICES", "GPUCLEAN_PROBE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUCLEAN_LOCK_DIR", str(pytester.path / "locks"))
    pytester.makepyfile(test_inner=INNER)
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("-p", "gpuclean", "-p", "no:cacheprovider", "-rA", "-v",
                                           f"--gpuclean-report={report}", "--gpuclean-probe=after-incident",
                                           timeout=600)
    print(result.stdout.str())
    result.assert_outcomes(passed=3, errors=2)
    out = result.stdout.str()
    for test in ("test_child_kernel_faults", "test_own_kernel_faults"):
        assert f"ERROR at teardown of {test}" in out
    assert out.count("gpuclean: GPU fault during the test") == 2
    xid31 = ": Xid 31 (GPU memory page fault (MMU fault): a kernel accessed an illegal address)"
    assert out.count(xid31) >= 2
    assert "PASSED test_inner.py::test_next_passes" in out
    tests = {t["nodeid"].split("::")[-1]: t for t in json.loads(report.read_text())["tests"]}
    for test in ("test_child_kernel_faults", "test_own_kernel_faults"):
        assert tests[test]["outcome"] == "gpu_fault"
        assert [(f["kind"], f["xid"], f["effect"]) for f in tests[test]["health"]
                if f["kind"] == "xid"] == [("xid", 31, "fault")]
    assert tests["test_next_passes"]["outcome"] == "clean", tests["test_next_passes"]
    print("health findings:", json.dumps({t: tests[t]["health"] for t in tests}, indent=1))
    print("check timings:", {t: tests[t]["timings"] for t in tests})


def test_the_probe_passes_on_every_gpu(tmp_path: Path) -> None:
    from pytest_gpuclean._reading import probe
    from pytest_gpuclean._reading.nvml import NvmlBackend
    backend = NvmlBackend()
    try:
        found = backend.devices()
        results = probe.run(found, simulate=None, timeout=120)
    finally:
        backend.close()
    assert results == {d.uuid: None for d in found}

"""Issue 44 item 1 on a real GPU: a library's pool kept in a module global is a helper of the pytest process,
found by who holds its handle, in a pytest process that imported torch (the walk runs over its objects); the
same pool holding CUDA memory after a test is judged (tests/test_managed.py shows both on simulated devices).

Run on one GPU: ``python3 -m pytest tests/gpu/test_gpu_managed.py -v -s -p no:cacheprovider``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_inner, summary_of
from test_gpu_guest import gpu_inner  # noqa: F401  (the fixture: inner sessions on the real GPU)

POOL_LIB = '''
"""A library that caches a spawn-context process pool in a module global, for the process's life."""
import concurrent.futures
import multiprocessing
import os

_EXECUTOR = None


def executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = concurrent.futures.ProcessPoolExecutor(
            max_workers=2, mp_context=multiprocessing.get_context("spawn"))
    return _EXECUTOR


def work(mib):
    """In a worker: hold mib MiB of the GPU (0: none), record this worker's pid."""
    if mib:
        import gpu_use
        gpu_use.use_cuda(mib)
    with open(os.path.join(os.environ["GPU_GUEST_PIDS"], "worker-%d.pid" % os.getpid()), "w") as f:
        f.write(str(os.getpid()))
    return os.getpid()
'''

INNER = '''
import os

import pool_lib
import pytest
import torch  # (the pytest process imports torch, as a GPU suite does: the walk goes over its objects)

MIB = int(os.environ.get("POOL_MIB", "0"))


@pytest.mark.needs_clean_gpus
def test_first_use_starts_the_pool():
    assert torch.cuda.is_available()
    assert pool_lib.executor().submit(pool_lib.work, MIB).result() in pool_lib.executor()._processes


@pytest.mark.needs_clean_gpus
def test_later_use_finds_it():
    assert pool_lib.executor().submit(pool_lib.work, 0).result() in pool_lib.executor()._processes
'''


def test_a_librarys_pool_is_a_helper_and_judged_once_it_holds_gpu_memory(
        gpu_inner: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    pytester.makepyfile(pool_lib=POOL_LIB, test_inner=INNER)
    result = run_inner(pytester, "--gpuclean-all")
    result.assert_outcomes(passed=2)
    summary = summary_of(result)
    print("\n".join(summary))
    assert summary[-1] == "2 checked test(s), 0 with findings, 0 process(es) reaped"
    assert any("is kept in pool_lib._EXECUTOR, started during test_inner.py::test_first_use_starts_the_pool"
               in line for line in summary), summary
    # Its worker holds 256 MiB of the GPU after the first test: judged like any process, the test's leak.
    monkeypatch.setenv("POOL_MIB", "256")
    holding = run_inner(pytester, "--gpuclean-all", "-k", "first_use")
    print(holding.stdout.str()[-3000:])
    holding.assert_outcomes(passed=1, errors=1)
    assert "is a helper of the pytest process (its handle" not in holding.stdout.str()

"""The checker's memory arithmetic, in-process, against a fake device backend.

Only the public ``Checker(...).check(...)`` is used: what counts against the tolerance, what the pytest
process's own context is excused for, and how findings are reported. The census still looks at this
process's real children; the project's tests leave none behind, so there are none.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import exec_done

from pytest_gpuclean._check.checker import Checker, CheckSettings
from pytest_gpuclean._model.records import MIB, CheckResult, DeviceInfo, DeviceSnapshot, GpuProcess
from pytest_gpuclean._ownership.census import Census, XdistPeers

GPU0 = DeviceInfo(0, "GPU-fake-0", "Fake GPU")
GPU1 = DeviceInfo(1, "GPU-fake-1", "Fake GPU")
ME = os.getpid()


def absent_pid() -> int:
    # A pid no process has: the driver lists processes of other PID namespaces like that.
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    return pid


@dataclass
class FakeBackend:
    """Devices whose readings the test sets: ``used`` MiB and ``(pid, MiB)`` listed processes."""

    values: dict[str, tuple[float, tuple[tuple[int, float | None], ...]]] = field(default_factory=dict)
    cuda: dict[int, frozenset[str]] = field(default_factory=dict)
    kind: str = "simulated"
    notices: list[str] = field(default_factory=list)

    def set(self, device: DeviceInfo, used_mib: float, *listed: tuple[int, float | None]) -> None:
        self.values[device.uuid] = (used_mib, listed)

    def devices(self) -> tuple[DeviceInfo, ...]:
        return (GPU0, GPU1)

    def snapshot(self, device: DeviceInfo) -> DeviceSnapshot:
        used, listed = self.values.get(device.uuid, (0, ()))
        return DeviceSnapshot(device, int(used * MIB), 1000 * MIB, tuple(
            GpuProcess(pid, None if mib is None else int(mib * MIB)) for pid, mib in listed))

    def readings(self, devices: Sequence[DeviceInfo]) -> tuple[DeviceSnapshot, ...]:
        return tuple(self.snapshot(d) for d in devices)

    def cuda_users(self, pids: Iterable[int]) -> dict[int, frozenset[str]]:
        return {pid: self.cuda[pid] for pid in pids if pid in self.cuda}

    def driver_version(self) -> str:
        return "fake"

    def close(self) -> None:
        pass


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


def check(backend: FakeBackend, tolerance_mib: int = 0, devices: tuple[DeviceInfo, ...] = (GPU0,)
          ) -> CheckResult:
    checker = Checker(backend, CheckSettings(reap=False, dead_sessions=False))  # (never another run's debris)
    return checker.check("check", devices, tolerance_mib=tolerance_mib, timeout=0)


def memory_findings(result: CheckResult) -> list[tuple[str, float]]:
    return [pair for o in result.offenders if o.reason == "memory" for pair in o.mib_per_device]


def test_idle_devices_are_clean(backend: FakeBackend) -> None:
    result = check(backend, devices=(GPU0, GPU1))
    assert (result.clean, result.offenders, result.phase, result.tolerance_mib) == (True, (), "check", 0)
    assert [s.device for s in result.devices] == [GPU0, GPU1]
    assert result.clean_after_s is not None


def test_an_idle_check_takes_the_short_way_to_the_same_result(backend: FakeBackend,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing of ours alive and every device idle: Checker._clean_path answers without a Check's bookkeeping.
    # Its result must be the one a full round gives, and anything there must take the full round.
    checker = Checker(backend, CheckSettings(reap=False))
    devices = (GPU0, GPU1)
    checker.check("setup", devices, tolerance_mib=5, timeout=0)  # (the first looks for dead sessions)
    rounds: list[int] = []
    observe = Checker.observe
    monkeypatch.setattr(Checker, "observe", lambda self, look: rounds.append(1) or observe(self, look))
    quiet = checker.check("setup", devices, tolerance_mib=5, timeout=0)
    assert rounds == []
    full = checker.check("setup", devices, tolerance_mib=5, timeout=0, scan_cookies=True)
    assert rounds == [1]
    same = [name for name in CheckResult.__slots__ if name not in ("waited_s", "clean_after_s")]
    assert [getattr(quiet, n) for n in same] == [getattr(full, n) for n in same]
    assert quiet.clean and quiet.clean_after_s is not None
    # Memory charged to no process (within the tolerance): the full round, which looks at whose it is.
    backend.values[GPU1.uuid] = (1, ())
    assert checker.check("setup", devices, tolerance_mib=5, timeout=0).clean
    assert rounds == [1, 1]
    backend.values.clear()
    # A process of ours alive, holding no GPU memory: the full round, which weighs it (started outside
    # any test, it is the session set-up's here: protected, and the check is clean).
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert checker.check("teardown", devices, tolerance_mib=5, timeout=0).clean
        assert rounds == [1, 1, 1]
        assert child.pid in {f.pid for f in checker.last_census}
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(("used_mib", "tolerance_mib", "clean"), [(16, 16, True), (17, 16, False),
                                                                  (1, 0, False)])
def test_unattributed_memory_counts_against_the_tolerance(backend: FakeBackend, used_mib: float,
                                                          tolerance_mib: int, clean: bool) -> None:
    backend.set(GPU0, used_mib)
    result = check(backend, tolerance_mib)
    assert result.clean is clean
    assert memory_findings(result) == ([] if clean else [("GPU 0", used_mib)])
    if not clean:
        [offender] = result.offenders
        assert (offender.process, offender.found_by) == (None, "gpu")
        assert offender.detail == (f"{used_mib:.0f} MiB used on GPU 0 beyond the tolerance of "
                                   f"{tolerance_mib} MiB, held by no process we can see")


def test_a_listed_process_fails_whatever_the_tolerance(backend: FakeBackend) -> None:
    stranger = absent_pid()
    backend.set(GPU0, 512, (stranger, 512))
    result = check(backend, tolerance_mib=4096)
    assert not result.clean
    [offender] = result.offenders  # its memory is its own, not reported again as unattributed
    assert (offender.reason, offender.found_by, offender.owner) == ("foreign", "gpu", None)
    assert offender.process is not None and offender.process.pid == stranger
    assert offender.mib_per_device == (("GPU 0", 512.0),)


def test_only_the_devices_under_check_count(backend: FakeBackend) -> None:
    backend.set(GPU1, 900, (absent_pid(), 900))
    assert check(backend, devices=(GPU0,)).clean
    assert not check(backend, devices=(GPU0, GPU1)).clean


def test_this_processs_own_context_is_excused_and_reported(backend: FakeBackend) -> None:
    # The context's unlisted overhead (charged to no process) is excused up to a bound per context.
    backend.set(GPU0, 600 + 40, (ME, 600))
    result = check(backend)
    assert result.clean, result.offenders
    assert result.self_mib == (("GPU 0", 600.0),)


def test_overhead_beyond_the_bound_of_the_listed_contexts_is_dirty(backend: FakeBackend) -> None:
    backend.set(GPU0, 600 + 100, (ME, 600))
    result = check(backend)
    assert memory_findings(result) == [("GPU 0", 100 - 64)]
    assert check(backend, tolerance_mib=36).clean


def test_cuda_without_a_context_is_excused_for_this_process_only(backend: FakeBackend) -> None:
    # Initialising CUDA costs a few MiB the driver lists under no process.
    backend.set(GPU0, 3)
    assert not check(backend).clean
    backend.cuda[ME] = frozenset({GPU0.uuid})
    result = check(backend)
    assert result.clean, result.offenders
    assert result.self_cuda_only == ("GPU 0",)


def test_memory_on_a_device_with_a_foreign_process_is_blamed_on_it_once(backend: FakeBackend) -> None:
    stranger = absent_pid()
    backend.set(GPU0, 600 + 200 + 30, (ME, 600), (stranger, 200))
    backend.set(GPU1, 30)
    result = check(backend, devices=(GPU0, GPU1))
    # GPU 0: the foreign holder is the finding, its device's unlisted 30 MiB is not reported again;
    # GPU 1: nobody is listed, so the same 30 MiB is a finding of its own.
    assert [(o.reason, o.mib_per_device) for o in result.offenders] == [
        ("foreign", (("GPU 0", 200.0),)), ("memory", (("GPU 1", 30.0),))]


def test_a_process_without_a_memory_figure_counts_as_zero(backend: FakeBackend) -> None:
    backend.set(GPU0, 50, (absent_pid(), None))
    result = check(backend, tolerance_mib=100)
    [offender] = result.offenders
    assert offender.reason == "foreign" and offender.mib_per_device == (("GPU 0", 0.0),)


# ---- an outside state a check waited out ------------------------------------------------------------

# (dead_sessions=False: the debris of another suite's killed session on this host is not what they test.)

def outside_check(checker: Checker, timeout: float = 0, where: str = "t.py::test_1",
                  tolerance_mib: int = 0) -> CheckResult:
    return checker.check("setup", (GPU0,), tolerance_mib=tolerance_mib, timeout=timeout, where=where)


def test_an_unchanged_outside_state_is_known_and_still_dirty(backend: FakeBackend) -> None:
    stranger = absent_pid()
    backend.set(GPU0, 512, (stranger, 512))
    checker = Checker(backend, CheckSettings(reap=False, dead_sessions=False))
    first = outside_check(checker)
    assert first.outside is not None and (first.outside.same_as, first.outside.only) == (None, True)
    second = outside_check(checker, where="t.py::test_2")
    # Known, and never clean for it: the remembered state only spares the wait.
    assert not second.clean and [o.reason for o in second.offenders] == ["foreign"]
    assert second.outside is not None and second.outside.same_as == "t.py::test_1"
    assert second.outside.devices == (("GPU 0", 512.0),)


@pytest.mark.parametrize(("then_mib", "tolerance_mib", "known"), [
    (512 + 16, 0, True), (512 - 16, 0, True), (512 + 17, 0, False), (512 + 40, 50, True),
    (512 + 60, 50, False)])
def test_outside_memory_is_the_same_within_the_slack_or_the_tolerance(
        backend: FakeBackend, then_mib: float, tolerance_mib: int, known: bool) -> None:
    # 16 MiB (OUTSIDE_SLACK_BYTES): a CUDA context of ours that the driver charges to no process.
    backend.set(GPU0, 512)
    checker = Checker(backend, CheckSettings(reap=False, dead_sessions=False))
    outside_check(checker, tolerance_mib=tolerance_mib)
    backend.set(GPU0, then_mib)
    result = outside_check(checker, where="t.py::test_2", tolerance_mib=tolerance_mib)
    assert result.outside is not None and (result.outside.same_as is not None) is known


def test_a_new_process_on_a_reused_pid_is_a_new_outside_state(backend: FakeBackend,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_gpuclean._check import checker as checker_module
    stranger = absent_pid()
    backend.set(GPU0, 512, (stranger, 512))
    checker = Checker(backend, CheckSettings(reap=False, dead_sessions=False))
    monkeypatch.setattr(checker_module, "_start_ticks", lambda pid: 1000)
    outside_check(checker)
    monkeypatch.setattr(checker_module, "_start_ticks", lambda pid: 2000)  # same pid, started later
    result = outside_check(checker, where="t.py::test_2")
    assert result.outside is not None and result.outside.same_as is None
    again = outside_check(checker, where="t.py::test_3").outside
    assert again is not None and again.same_as == "t.py::test_2"


def test_a_device_clean_from_outside_forgets_what_held_it(backend: FakeBackend) -> None:
    backend.set(GPU0, 512)
    checker = Checker(backend, CheckSettings(reap=False, dead_sessions=False))
    outside_check(checker)
    backend.set(GPU0, 0)
    assert outside_check(checker, where="t.py::test_2").clean
    backend.set(GPU0, 512)  # the same figure again, but it went away in between: new, waited for
    result = outside_check(checker, where="t.py::test_3")
    assert result.outside is not None and result.outside.same_as is None


class FakeClock:
    """``time`` as the checker sees it: ``sleep`` moves ``monotonic`` on, nothing really waits."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_check_with_a_longer_timeout_waits_the_difference(backend: FakeBackend,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_gpuclean._check import checker as checker_module

    clock = FakeClock()
    monkeypatch.setattr(checker_module, "time", clock)  # (when a check starts, and its passes)
    backend.set(GPU0, 512)
    checker = Checker(backend, CheckSettings(reap=False, dead_sessions=False))
    assert outside_check(checker, timeout=1).waited_s >= 1  # new: waited out in full
    clock.sleep(2)
    # Unchanged for 3 s since the first check first saw it: a check that would wait 5 s waits the 2 s
    # left; one that would wait 2 s does not wait at all.
    longer = outside_check(checker, timeout=5, where="t.py::test_2")
    assert longer.outside is not None and longer.outside.same_as == "t.py::test_1"
    assert 1.9 < longer.waited_s < 2.1
    shorter = outside_check(checker, timeout=2, where="t.py::test_3")
    assert shorter.outside is not None and shorter.outside.same_as == "t.py::test_1"
    assert shorter.waited_s == 0


def test_a_foreign_process_of_our_xdist_run_is_not_outside(backend: FakeBackend,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # A sibling worker's leftover is the run's, not outside the session: never remembered, so never
    # spared the wait (its worker accounts for it).
    cookie = "gc.1.2.3.aa:session/gc.4.5.3.bb:t7"
    sibling = exec_done(subprocess.Popen(["sleep", "600"], env={**os.environ, "GPUCLEAN_TEST": cookie}))
    try:
        backend.set(GPU0, 512, (sibling.pid, 512))
        peers = XdistPeers(run="run1", cookie="gc.1.2.3.aa:session")
        checker = Checker(backend, CheckSettings(reap=False, dead_sessions=False),
                          Census.of_its_own(peers=peers))
        monkeypatch.setattr(checker.census, "take", lambda *args: [])  # (not under this process, as in a run)
        for where in ("t.py::test_1", "t.py::test_2"):
            result = outside_check(checker, where=where)
            assert [o.reason for o in result.offenders] == ["foreign"] and result.outside is None
        assert checker.outside.load() == {}
    finally:
        sibling.kill()
        sibling.wait()


def test_an_outside_holder_that_has_exited_is_a_changed_state(backend: FakeBackend,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # The driver may list a holder for a moment after it exited, while it gives the memory back: that is
    # not the state an earlier check waited out, and the check waits (for it to go).
    holder = subprocess.Popen(["sleep", "600"])
    try:
        backend.set(GPU0, 512, (holder.pid, 512))
        checker = Checker(backend, CheckSettings(reap=False, dead_sessions=False))
        monkeypatch.setattr(checker.census, "take", lambda *args: [])  # (not ours, as if started elsewhere)
        outside_check(checker)
        known = outside_check(checker, where="t.py::test_2").outside
        assert known is not None and known.same_as == "t.py::test_1"
        holder.kill()
        stat = Path(f"/proc/{holder.pid}/stat")
        while stat.read_text().rsplit(")")[1].split()[0] != "Z":
            time.sleep(0.01)
        result = outside_check(checker, where="t.py::test_3")  # a zombie still listed: changing
        assert result.outside is not None and result.outside.same_as is None
    finally:
        holder.kill()
        holder.wait()


# ---- the pytest process's own context: a repeat of a clean reading is that verdict again -------------


@pytest.fixture
def own_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Checker, list[int], Path]:
    """A checker over simulated devices on which this process holds 600 MiB (a torch suite's pytest
    process), and a count of the full checks it runs (``Check.run``)."""
    from pytest_gpuclean._check import checker as checker_module
    from pytest_gpuclean._reading.simulated import SimulatedBackend
    from pytest_gpuclean.simulate import allocate, init

    sim = tmp_path / "sim"
    init(str(sim), 2, 80 * 1024)
    own = allocate(str(sim), 0, 600)
    runs: list[int] = []
    real_run = checker_module._Passes.run

    def counted(self: checker_module._Passes) -> CheckResult:
        runs.append(1)
        return real_run(self)

    monkeypatch.setattr(checker_module._Passes, "run", counted)
    return Checker(SimulatedBackend(sim), CheckSettings(dead_sessions=False)), runs, own


def test_a_clean_reading_of_our_own_context_repeated_is_the_same_verdict(
        own_context: tuple[Checker, list[int], Path]) -> None:
    checker, runs, _own = own_context
    devices = checker.backend.devices() if checker.backend else ()
    first = check_devices(checker, devices)
    assert first.clean and first.self_mib == (("GPU 0", 600.0),) and runs == [1]
    again = check_devices(checker, devices, phase="teardown")
    # No check's passes the second time, and the same verdict, as the full check gives it.
    assert runs == [1]
    assert (again.phase, again.clean, again.devices, again.self_mib) == ("teardown", True, first.devices,
                                                                         first.self_mib)
    assert (again.offenders, again.reaped, again.notes) == ((), (), ())


def test_a_changed_reading_or_a_process_of_ours_is_checked_in_full(
        own_context: tuple[Checker, list[int], Path], tmp_path: Path) -> None:
    from pytest_gpuclean.simulate import allocate

    checker, runs, own = own_context
    devices = checker.backend.devices() if checker.backend else ()
    check_devices(checker, devices)
    # This process's use grew: another reading, a full check (still clean: its own).
    allocate(str(tmp_path / "sim"), 0, 700)
    assert check_devices(checker, devices).clean and len(runs) == 2
    assert check_devices(checker, devices).clean and len(runs) == 2  # (the new reading, repeated)
    # The same reading, but a child of ours alive (no memory): a check in full decides about it (here,
    # born outside any test's window, it is the session set-up's: clean).
    child = exec_done(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    try:
        check_devices(checker, devices, timeout=0.2, reap=False)
        assert len(runs) == 3
    finally:
        child.kill()
        child.wait()
    assert own.exists()


def check_devices(checker: Checker, devices: Sequence[DeviceInfo], *, phase: str = "setup",
                  timeout: float = 2.0, reap: bool | None = None) -> CheckResult:
    return checker.check(phase, devices, tolerance_mib=0, timeout=timeout, reap=reap)  # type: ignore[arg-type]

"""GPU health (issue 28) on simulated devices: Xid events blamed on the test during which they arrived, GPUs
that need a reset, a lost GPU, settings changed during a test, clock event reasons, and the CUDA probe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_gpuclean import simulate
from pytest_gpuclean._check.health import HealthWatch, xid_meaning
from pytest_gpuclean._model.records import DeviceHealth, DeviceInfo
from pytest_gpuclean._reading import devices, simulated


def run(pytester: pytest.Pytester, suite: str, *args: str) -> tuple[pytest.RunResult, dict[str, dict]]:
    """The inner session of tests/examples/health/``suite`` (with gpu_health.py: SIM, child_xid)."""
    pytester.copy_example("health/gpu_health.py")
    pytester.copy_example(f"health/{suite}")
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("-p", "gpuclean", "-p", "no:cacheprovider", "-rA",
                                           f"--gpuclean-report={report}", *args)
    tests = {t["nodeid"].split("::")[-1]: t for t in json.loads(report.read_text())["tests"]}
    return result, tests


def test_an_xid_during_a_test_is_its_fault_named_and_the_next_test_passes(
        pytester: pytest.Pytester, sim: Path) -> None:
    junit = pytester.path / "junit.xml"
    result, tests = run(pytester, "xid_faults", f"--junitxml={junit}")
    result.assert_outcomes(passed=3, errors=2)
    out = result.stdout.str()
    assert "ERROR at teardown of test_kernel_faults" in out
    assert "gpuclean: GPU fault during the test" in out
    assert "GPU 0: Xid 31 (GPU memory page fault (MMU fault): a kernel accessed an illegal address)" in out
    assert "GPU 1: Xid 13 (graphics engine exception" in out
    assert "PASSED test_inner.py::test_next" in out
    assert tests["test_kernel_faults"]["outcome"] == "gpu_fault"
    assert [(f["kind"], f["effect"], f["xid"], f["device"], f["phase"]) for f in
            tests["test_kernel_faults"]["health"]] == [("xid", "fault", 31, "GPU 0", "teardown")]
    assert tests["test_child_faults"]["health"][0]["xid"] == 13
    assert tests["test_next"]["outcome"] == "clean" and tests["test_next"]["health"] == []
    assert 'name="gpuclean_xids" value="31"' in junit.read_text()


def test_informational_and_unknown_xids(pytester: pytest.Pytester, sim: Path) -> None:
    result, tests = run(pytester, "info_and_unknown")
    result.assert_outcomes(passed=2, errors=1)
    assert tests["test_info"]["outcome"] == "clean"
    assert [(f["effect"], f["xid"]) for f in tests["test_info"]["health"]] == [("info", 45)]
    assert "GPU 0: Xid 1234 (see NVIDIA's Xid catalogue" in result.stdout.str()
    assert tests["test_unknown"]["outcome"] == "gpu_fault"


def test_a_gpu_that_needs_a_reset_fails_this_test_and_every_later_one_on_it(
        pytester: pytest.Pytester, sim: Path) -> None:
    result, tests = run(pytester, "remap_pending", "--gpuclean-timeout=600")
    result.assert_outcomes(passed=1, errors=2)
    out = result.stdout.str()
    assert ("gpuclean: GPU not usable after the test (gpuclean never resets a GPU)\n"
            "  GPU 1 needs a reset: 1 memory row remap pending") in out
    assert "ERROR at setup of test_later" in out
    assert "gpuclean: GPU not usable before the test" in out
    assert tests["test_breaks_a_row"]["outcome"] == "not_clean"
    assert [(f["kind"], f["effect"]) for f in tests["test_breaks_a_row"]["health"]] == [
        ("xid", "info"), ("needs_reset", "unusable")]
    assert tests["test_later"]["outcome"] == "not_clean"
    assert tests["test_later"]["health"][0]["phase"] == "setup"
    assert (sim / "1" / "remap_pending").read_text() == "1"  # never reset, never changed


def test_a_gpu_that_needs_a_reset_at_session_start(pytester: pytest.Pytester, sim: Path) -> None:
    simulate.set_state(str(sim), 0, "remap_failed", "1")
    result, tests = run(pytester, "one_marked")
    result.assert_outcomes(errors=1)
    assert "gpuclean: GPU 0 needs a reset: a memory row remapping failed: tests on it fail at their setup" \
        in result.stdout.str()
    assert tests["test_a"]["health"][0]["kind"] == "needs_reset"


def test_a_failed_test_points_at_the_slow_reads(pytester: pytest.Pytester, sim: Path) -> None:
    simulate.set_state(str(sim), 0, "ecc_uncorrected", "3")  # before the session: not its finding
    result, tests = run(pytester, "fails_on_a_changed_gpu")
    result.assert_outcomes(failed=1, errors=1)
    out = result.stdout.str()
    assert "GPU 0 needs a reset: 2 uncorrectable ECC errors during the session" in out
    assert "GPU 1: compute mode Default -> Prohibited during the test" in out
    assert "clock event reasons" not in out  # information: the JSON report's
    kinds = [(f["kind"], f["effect"], f["device"]) for f in tests["test_fails"]["health"]]
    assert kinds == [("needs_reset", "unusable", "GPU 0"), ("changed", "fault", "GPU 1"),
                     ("clocks", "info", "GPU 1")]
    assert tests["test_fails"]["health"][2]["message"] == "GPU 1: clock event reasons hw_slowdown, hw_thermal"


def test_a_reaped_gpu_process_points_at_the_slow_reads(pytester: pytest.Pytester, sim: Path,
                                                       inner: object) -> None:
    result, tests = run(pytester, "leaks_on_a_gpu_to_remap", "--gpuclean-settle=0", "--gpuclean-grace=1")
    result.assert_outcomes(passed=1, errors=1)
    out = result.stdout.str()
    assert "gpuclean: test leaked 1 process(es) (reaped)" in out
    assert "GPU 0 needs a reset: 2 memory row remaps pending" in out
    assert [f["kind"] for f in tests["test_leaks"]["health"]] == ["needs_reset"]


@pytest.mark.parametrize("how", ["lost file", "xid 79", "vanished"])
def test_a_lost_gpu_stops_the_session_with_one_line(pytester: pytest.Pytester, sim: Path,
                                                    monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    monkeypatch.setenv("HOW", how)
    result, tests = run(pytester, "lose_gpu", "--gpuclean-timeout=600")
    out = result.stdout.str()
    assert "stopping the session's tests instead of letting each wait its timeout" in out
    assert "Interrupted: gpuclean: GPU 0" in out
    assert "test_never_runs" not in tests
    assert tests["test_loses_it"]["outcome"] == "not_clean"
    assert any(f["effect"] == "lost" for f in tests["test_loses_it"]["health"])


# ---- the simulated backend and the watch, in-process --------------------------------------------------

def test_simulated_xids_are_those_appended_since_the_watch_began(tmp_path: Path) -> None:
    simulate.init(str(tmp_path), 2, 1024)
    simulate.xid(str(tmp_path), 0, 48)  # before the watch: not an event of this session
    backend = simulated.SimulatedBackend(tmp_path)
    gpu0, gpu1 = backend.devices()
    assert backend.drain_xids() == []  # not watching yet
    assert backend.watch_xids(backend.devices())
    simulate.xid(str(tmp_path), 1, 31)
    with open(tmp_path / "xid", "a") as f:
        f.write("0 13\n0 94")  # the second line is still being written
    assert backend.drain_xids() == [(gpu1.uuid, 31), (gpu0.uuid, 13)]
    assert backend.drain_xids() == []
    with open(tmp_path / "xid", "a") as f:
        f.write("\nabc\n")
    with pytest.raises(devices.SimulationError, match="the line 'abc', not '<device index> <Xid code>'"):
        backend.drain_xids()


def test_the_watch_blames_only_the_tests_devices(tmp_path: Path) -> None:
    simulate.init(str(tmp_path), 2, 1024)
    backend = simulated.SimulatedBackend(tmp_path)
    gpu0, gpu1 = backend.devices()
    notes: list[str] = []
    watch = HealthWatch(backend, (gpu0, gpu1), note=notes.append)
    assert watch.start() == []
    assert watch.before("t::a", (gpu0,), 0) == []
    simulate.xid(str(tmp_path), 1, 31)  # on a GPU this test does not use
    simulate.xid(str(tmp_path), 0, 43)
    found = watch.after("t::a", (gpu0,), (), 0)
    assert [(f.device, f.xid, f.effect) for f in found] == [("GPU 0", 43, "fault")]
    assert notes == ["gpuclean: GPU 1: Xid 31 (GPU memory page fault (MMU fault): a kernel accessed an "
                     "illegal address), outside any test on it (during t::a)"]
    assert watch.incidents == {gpu0.uuid, gpu1.uuid}


class CountingBackend(simulated.SimulatedBackend):
    reads = 0

    def health(self, device: DeviceInfo) -> DeviceHealth:
        self.reads += 1
        return super().health(device)


def test_the_slow_reads_wait_for_something_to_point_at_them(tmp_path: Path) -> None:
    simulate.init(str(tmp_path), 2, 1024)
    backend = CountingBackend(tmp_path)
    watch = HealthWatch(backend, backend.devices())
    watch.start()
    assert backend.reads == 2  # the baseline
    for failed in (0, 1):
        watch.before("t::a", backend.devices(), 0)  # (the count of failed tests at its setup)
        simulate.set_state(str(tmp_path), 1, "persistence", "off")
        found = watch.after("t::a", backend.devices(), (), failed)
        # The clean test cost no slow read (nor saw the change); the failed one read both devices.
        assert backend.reads == 2 + 2 * failed
    assert [f.message for f in found] == ["GPU 1: persistence mode on -> off during the test"]


def test_the_xid_table_decides_what_fails() -> None:
    assert [c for c in (13, 31, 43, 68, 999) if xid_meaning(c)[0] == "fault"] == [13, 31, 43, 68, 999]
    assert [c for c in (48, 61, 62, 64, 74, 94, 95, 119, 120) if xid_meaning(c)[0] == "unusable"] == [
        48, 61, 62, 64, 74, 94, 95, 119, 120]
    assert xid_meaning(79)[0] == "lost"
    assert [c for c in (45, 63, 92) if xid_meaning(c)[0] == "info"] == [45, 63, 92]


# ---- the gpuclean command -----------------------------------------------------------------------------

def _gpuclean(sim: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_gpuclean", *args], capture_output=True, text=True,
                          env={**os.environ, "GPUCLEAN_SIMULATE": str(sim)}, timeout=60)


def test_status_shows_health_and_check_has_an_exit_status_of_its_own(sim: Path) -> None:
    assert _gpuclean(sim, "check").returncode == 0
    status = _gpuclean(sim, "status").stdout
    assert "GPU 1      health: ok (compute mode Default, persistence on, MIG off)" in status
    simulate.set_state(str(sim), 1, "remap_pending", "1")
    checked = _gpuclean(sim, "check", "--wait", "600")
    assert checked.returncode == 3, checked.stderr
    assert "gpuclean check: NOT USABLE: 1 GPU(s) need a reset or are lost" in checked.stdout
    assert "GPU 1 (GPU-" in checked.stdout and "1 memory row remap pending" in checked.stdout
    assert "GPU 1      health: NOT USABLE: 1 memory row remap pending" in _gpuclean(sim, "status").stdout
    simulate.set_state(str(sim), 1, "remap_pending", None)
    simulate.set_state(str(sim), 0, "lost", "fallen off the bus")
    document = json.loads(_gpuclean(sim, "check", "--json").stdout)
    assert document["usable"] is False
    assert [(h["device"], h["lost"], h["problems"]) for h in document["health"]] == [
        ("GPU 0", True, ["lost: fallen off the bus"]), ("GPU 1", False, [])]
    assert _gpuclean(sim, "check").returncode == 3
    assert "GPU 0      health: LOST: fallen off the bus" in _gpuclean(sim, "status").stdout


# ---- the CUDA probe ------------------------------------------------------------------------------------

def test_the_probe_after_an_incident_finds_a_gpu_that_cannot_make_a_context(
        pytester: pytest.Pytester, sim: Path) -> None:
    result, tests = run(pytester, "probed", "--gpuclean-probe=after-incident")
    result.assert_outcomes(passed=1, errors=2)
    assert ("gpuclean: GPU not usable before the test (gpuclean never resets a GPU)\n  GPU 0 failed the CUDA "
            "probe: cuCtxCreate returned 999 (CUDA_ERROR_UNKNOWN)") in result.stdout.str()
    assert [(f["kind"], f["effect"], f["phase"]) for f in tests["test_next"]["health"]] == [
        ("probe", "unusable", "setup")]


def test_without_the_probe_the_next_test_runs(pytester: pytest.Pytester, sim: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCLEAN_PROBE", "off")
    result, tests = run(pytester, "probed")
    result.assert_outcomes(passed=2, errors=1)
    assert tests["test_next"]["outcome"] == "clean"


def test_the_probe_at_start_and_its_deadline(pytester: pytest.Pytester, sim: Path) -> None:
    simulate.set_state(str(sim), 1, "probe_hangs", "1")
    result, tests = run(pytester, "one_marked", "--gpuclean-probe=start", "--gpuclean-timeout=1")
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert ("gpuclean: GPU 1 failed the CUDA probe: no answer within the 1s deadline (the probe was killed): "
            "tests on it fail at their setup") in out
    assert "gpuclean: CUDA probe of 2 device(s) took" in out
    assert [f["device"] for f in tests["test_a"]["health"]] == ["GPU 1"]  # GPU 0 passed


def test_the_probe_before_each_test(pytester: pytest.Pytester, sim: Path) -> None:
    result, _tests = run(pytester, "probe_each", "--gpuclean-probe=each")
    result.assert_outcomes(passed=1, errors=1)
    assert "GPU 1 failed the CUDA probe: read back other bytes than it wrote" in result.stdout.str()


def test_a_bad_probe_mode_names_the_option_and_its_source(pytester: pytest.Pytester, sim: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_inner="def test_a(): pass")
    monkeypatch.setenv("GPUCLEAN_PROBE", "sometimes")
    result = pytester.runpytest_subprocess("-p", "gpuclean")
    result.stderr.fnmatch_lines(["ERROR: --gpuclean-probe: 'sometimes' is not one of off, start, "
                                 "after-incident, each (from environment variable GPUCLEAN_PROBE)"])

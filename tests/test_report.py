"""Formatting and serialisation of findings, in-process: text report, summary, JSON shapes, round trips."""

from __future__ import annotations

import dataclasses
import inspect
import json
from dataclasses import replace
from typing import Any, get_args

import pytest

from pytest_gpuclean._check import reap_plan
from pytest_gpuclean._model import outcomes
from pytest_gpuclean._model import records as model
from pytest_gpuclean._model.outcomes import has_findings
from pytest_gpuclean._model.records import (
    MIB,
    CheckResult,
    ClusterReading,
    Credentials,
    DeviceInfo,
    DeviceSnapshot,
    FixtureLeak,
    GpuProcess,
    HealthFinding,
    HolderRecord,
    LockHolder,
    NodeReading,
    NodeRelease,
    Offender,
    Outside,
    Owner,
    ProcessInfo,
    Reaped,
    SiblingUse,
)
from pytest_gpuclean._model.records import TestRecord as Record
from pytest_gpuclean._session import store
from pytest_gpuclean.ray import reporting as ray_reporting
from pytest_gpuclean.report import ci, jsonreport, terminal
from pytest_gpuclean.report.serialize import from_dict, to_dict

GPU0 = DeviceInfo(0, "GPU-0000", "H200")
MIG = DeviceInfo(1, "MIG-1111", "A100", mig_index=2)
PROC = ProcessInfo(pid=4242, start_ticks=99, ppid=1, uid=1000, user="ci", cmdline="python -c\n'hold()'",
                   state="sleeping")
TEST = Owner("test", "t.py::test_leaks")
SNAP = DeviceSnapshot(GPU0, 600 * MIB, 1000 * MIB, (GpuProcess(4242, 512 * MIB), GpuProcess(7, None)))
REAPED = Reaped(PROC, TEST, "descendant", "SIGTERM", (("GPU 0", 512.0),), 0.25, 0.125)
SURVIVED = Reaped(PROC, TEST, "adopted", "survived", (), None, survived_as="uninterruptible sleep (D)")
LEAKED = Offender("leaked", PROC, TEST, "cookie", (("GPU 0", 512.0),), "reaping is off")
MEMORY = Offender("memory", None, None, "gpu", (("GPU 0", 88.0),),
                  "88 MiB used on GPU 0 beyond the tolerance")
AFTER = CheckResult("teardown", False, (SNAP,), (LEAKED, MEMORY), reaped=(REAPED,), waited_s=1.5,
                    clean_after_s=None, notes=("a note",), tolerance_mib=16, collected=(REAPED,),
                    lingered=(LEAKED,), self_mib=(("GPU 0", 3.0),), self_cuda_only=("GPU 1/MIG 2",))
BEFORE = CheckResult("setup", True, (SNAP,), ())
RECORD = Record("t.py::test_leaks", ("t.py", 12), BEFORE, AFTER, (SURVIVED,), (("cuda:0", 1.5),),
                ("GPU-0000",), lock_wait_s=0.5, before_s=0.01, after_s=1.5)
NO_LOCKS = Record("t.py::test_waits", ("t.py", 20), lock_wait_s=600.0,
                  lock_timeout="waited 600s for 1 of 1 GPU lock(s); held by: GPU-0000: pid 1")
ENGINE = Owner("fixture", "engine (session-scoped)")
ENGINE_LEAK = FixtureLeak("engine", "session", ("conftest.py", 12), "t2.py::test_d",
                          (REAPED._replace(owner=ENGINE),),
                          (LEAKED._replace(owner=ENGINE),),
                          (LEAKED._replace(owner=ENGINE),))
UNREADABLE = CheckResult("teardown", False, (), (), reaped=(REAPED,), waited_s=0.01,
                         error="GPU 1 (GPU-1111): simulated device file '/s/1/7' holds 'x'", device_lost=True)
FIXTURE_RECORD = Record("t2.py::test_d", ("t2.py", 4), BEFORE, BEFORE._replace(phase="teardown"),
                        fixture_leaks=(ENGINE_LEAK,))

# What another xdist worker found: a process of t.py::test_leaks on a GPU its own test held the lock of.
SIBLING = SiblingUse(PROC, TEST, "gw0", (("GPU 0", 512.0),), "t.py::test_victim", "gw1", "teardown")
SEEN_SIBLING = CheckResult("teardown", True, (SNAP,), (),
                           siblings=(SIBLING._replace(seen_by="", seen_worker="", phase=None),),
                           notes=("pid 4242: in use by gw0's test ...",))
UNCHECKED_USER = Record("t.py::test_leaks", gpu_without_lock=(SIBLING,))

XID = HealthFinding("xid", "fault", "GPU 0", "GPU-0000", "GPU 0: Xid 31 (MMU fault)", "teardown", 31)
HEALTH = model.DeviceHealth(1, False, 2, "Default", "off", "on")
FAULTED = Record("t.py::test_faults", ("t.py", 40), BEFORE, BEFORE, health=(XID,))

OUTSIDE = Outside((("GPU 0", 88.0),), only=True, same_as="t.py::test_leaks")
OUTSIDE_CHECK = CheckResult("setup", False, (SNAP,), (MEMORY,), waited_s=0.01, tolerance_mib=16,
                            outside=OUTSIDE)
OUTSIDE_RECORD = Record("t.py::test_skipped", ("t.py", 40), OUTSIDE_CHECK, outside_action="skip")

NODE = "3f2a9c1b" + "0" * 48
RAY_SNAP = DeviceSnapshot(DeviceInfo(0, "GPU-0000", f"node {NODE[:8]}: H200"), 600 * MIB, 1000 * MIB,
                          (GpuProcess(4242, 512 * MIB),))
# A Ray cluster's check: an ordinary check whose findings name their node.
RAY_REAPED = REAPED._replace(ended_by="exited by itself", node=NODE, via="ray.kill", actor_id="a" * 32,
                             job_id="01000000")
RAY_LADDER = REAPED._replace(process=PROC._replace(pid=4243), node=NODE, via="ladder", job_id="01000000")
RAY_RELEASE = NodeRelease(NODE, 0.41, (4242,))
RAY_NODE = NodeReading(NODE, (RAY_SNAP,), "")
RAY_AFTER = CheckResult("teardown", False, (), (LEAKED._replace(node=NODE),),
                        (RAY_REAPED, RAY_LADDER), 0.5, notes=("a note",),
                        cluster=ClusterReading("127.0.0.1:6379", (RAY_NODE,), (RAY_RELEASE,)))
RAY_BEFORE = CheckResult("setup", True, (), (), cluster=ClusterReading(
    "127.0.0.1:6379", (NodeReading(NODE, (), "devices unreadable"),)))
UNREACHABLE = Offender("unreachable", None, None, "gpu", detail="lost the Ray cluster", node="")
RAY_RECORD = Record("t.py::test_ray", ("t.py", 30), BEFORE, BEFORE, cluster_before=RAY_BEFORE,
                    cluster_after=RAY_AFTER)

# What the clean_gpus fixture gives a test.
GPU_STATE = model.DeviceState(0, "GPU-0000", "H200", 600 * MIB, 1000 * MIB)
CLEAN_GPUS = model.CleanGpus((GPU_STATE, model.DeviceState(3, "GPU-3333", "H200", 0, 1000 * MIB)))
HOLDER_RECORD = HolderRecord(4242, 1000, "ci", "h", "t.py::test_holds", 1.5e9, "GPU-0000", start=99)
LOCK_HOLDER = LockHolder(HOLDER_RECORD, alive=False, lock_pid=4343, lock_user="ci",
                         lock_cmd="python -m pytest", queued=True)

# What `gpuclean reap` weighs, and what its --dry-run lists.
REAP_CANDIDATE = reap_plan.ReapCandidate(4242, PROC, (("GPU 0", 512.0),), "cookie", f"node {NODE[:8]}", True,
                                     True, True, "01000000", True, 4241, True, Credentials(
                                         4242, ((0, "root"), (1000, "ci")), (PROC._replace(pid=4243),)))
DRY_RUN_TARGET = terminal.DryRunTarget(f"node {NODE[:8]}: ", PROC, "job 01000000, by ray.kill",
                                    (("GPU 0", 512.0),))

# One fully populated instance of every record class in the model: each must survive a round trip.
EXAMPLES: list[Any] = [GPU0, MIG, PROC, TEST, SNAP, GpuProcess(1, None), REAPED, SURVIVED, LEAKED, MEMORY,
                       AFTER, BEFORE, RECORD, NO_LOCKS, Record("t.py::test_unchecked"), RAY_REAPED,
                       RAY_RELEASE, RAY_NODE, UNREACHABLE, RAY_AFTER, RAY_BEFORE,
                       RAY_AFTER.cluster, RAY_RECORD, ENGINE_LEAK, UNREADABLE, FIXTURE_RECORD, SIBLING,
                       SEEN_SIBLING,
                       UNCHECKED_USER, XID, HEALTH, FAULTED, OUTSIDE, OUTSIDE_CHECK,
                       OUTSIDE_RECORD, GPU_STATE, CLEAN_GPUS, HOLDER_RECORD, LOCK_HOLDER,
                       model.Selection((GPU0, MIG), "from CUDA_VISIBLE_DEVICES='0,1'", 3), REAP_CANDIDATE,
                       DRY_RUN_TARGET, REAP_CANDIDATE.credentials]


def test_cluster_findings_in_the_summary_and_the_json_report() -> None:
    # The Ray extension's parts (ray/reporting.py), as its report hooks give them to the summary and terminal.
    import jsonschema

    lines = terminal.summary_lines([RAY_RECORD], [], [], ray_reporting.summary_parts)
    assert lines[0] == (f"t.py::test_ray: Ray teardown on node {NODE[:8]}: reaped pid 4242 by ray.kill, "
                        "pid 4243 SIGTERM, devices released in 0.41s, not clean (leaked pid 4242)")
    assert lines[-1] == "1 checked test(s), 1 with findings, 2 process(es) reaped"
    # Without the extension's parts, the line keeps what gpuclean itself says of the test (the counts
    # include the cluster's findings: they are ordinary records).
    assert terminal.summary_lines([RAY_RECORD], [], [])[0] == "t.py::test_ray: "
    document = jsonreport.report_document(records=[RAY_RECORD], session_reaped=[], notes=[], session={
        "start": "2026-12-01T00:00:00.000+00:00", "end": "2026-12-01T00:00:01.000+00:00", "duration_s": 1.0,
        "exitstatus": 1, "host": "h", "backend": "simulated", "driver": "simulated", "unavailable": None,
        "devices": [], "settings": {"all": False, "tolerance_mib": 0, "timeout": 60.0, "scope": "session",
                                    "reap": "on", "grace": 5.0, "lock": "on", "require_gpu": False},
        "xdist_workers": None, "ray": ray_reporting.ray_json("127.0.0.1:6379", "2.60.0", [RAY_AFTER])},
        test_keys=ray_reporting.record_keys)
    jsonschema.validate(document, jsonreport.load_schema())
    (test,) = document["tests"]
    assert test["outcome"] == "leaked" and document["summary"]["reaped"] == 2
    assert [(e["node_id"], e["via"], e["ended_by"]) for e in test["leaked"]] == [
        (NODE, "ray.kill", "exited by itself"), (NODE, "ladder", "SIGTERM"), (NODE, None, None)]
    after = test["cluster_after"]
    assert after["releases"] == [{"node_id": NODE, "release_s": 0.41, "pids": [4242]}]
    assert after["nodes"][0]["devices"][0]["name"] == f"node {NODE[:8]}: H200"
    assert after["findings"][0]["node_id"] == NODE
    assert test["cluster_before"]["nodes"][0]["error"] == "devices unreadable"
    # After timings, where the extension's keys go.
    assert list(test)[list(test).index("timings") + 1:] == ["cluster_before", "cluster_after"]
    # Without a cluster, a test's record keeps its old keys only.
    assert ray_reporting.record_keys(RECORD) == {}
    assert jsonreport.record_json(RECORD, ray_reporting.record_keys) == jsonreport.record_json(RECORD)


def test_every_record_class_has_a_round_trip_example() -> None:
    classes = {cls for module in (model, outcomes) for _, cls in inspect.getmembers(module, inspect.isclass)
               if (dataclasses.is_dataclass(cls) or hasattr(cls, "_fields"))
               and cls.__module__ == module.__name__}
    # (the results' records live beside the decisions, in outcomes.py; OwnLeaks is a decision's answer, never
    # serialized; and two records declared where they are decided and worded, beside the model's)
    assert classes - {outcomes.OwnLeaks} | {reap_plan.ReapCandidate, terminal.DryRunTarget} == {
        type(e) for e in EXAMPLES}


def test_records_compare_hash_and_copy_by_their_fields() -> None:
    device = model.DeviceInfo(0, "GPU-a", "H200")
    same = model.DeviceInfo(0, "GPU-a", "H200")
    assert device == same and hash(device) == hash(same) and device is not same
    assert device != replace(device, mig_index=1) and device != model.GpuProcess(0, None)
    assert {device: 1}[same] == 1
    assert repr(device) == "DeviceInfo(index=0, uuid='GPU-a', name='H200', mig_index=None)"
    assert (model.Owner("test", "t"))._replace(kind="fixture") == model.Owner("fixture", "t")
    with pytest.raises(TypeError):
        hash(Record("t.py::test"))  # filled in as the test runs: no hash, as a mutable dataclass


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: type(e).__name__)
def test_round_trip_through_json_gives_an_equal_object(example: Any) -> None:
    data = json.loads(json.dumps(to_dict(example)))
    assert from_dict(type(example), data) == example


def test_a_record_keeps_its_sequence_types() -> None:
    back = from_dict(Record, json.loads(json.dumps(to_dict(RECORD))))
    assert isinstance(back.in_process_mib, tuple) and back.in_process_mib[0] == ("cuda:0", 1.5)
    assert isinstance(back.found_later, tuple) and isinstance(back.devices, tuple)
    assert back.after is not None and isinstance(back.after.offenders[0].mib_per_device[0], tuple)


def test_a_reaped_process_round_trips_alone() -> None:
    # How a forked child ships what a later check found (store.RecordStore.receive): the one path
    # that names Reaped at run time in serialize (CI's pytest-8 forked run caught it unloaded).
    assert from_dict(Reaped, json.loads(json.dumps(to_dict(REAPED)))) == REAPED


def test_reaped_lines_show_how_and_when() -> None:
    assert terminal.reaped_lines(REAPED) == [
        "  pid 4242 ended by SIGTERM after 0.25s (found as descendant, spawned by t.py::test_leaks): held "
        "GPU 0 512 MiB; the driver released it 0.12s after the SIGTERM",
        "      cmd: python -c 'hold()'"]
    assert terminal.reaped_lines(SURVIVED)[0] == (
        "  pid 4242 survived SIGKILL (uninterruptible sleep (D)) (found as adopted, spawned by "
        "t.py::test_leaks): held no GPU memory")


def test_a_process_no_signal_ended_reads_as_such() -> None:
    # A Ray actor's worker ended through ray.kill, or a leak that exited while the check waited: "ended by"
    # names a signal, and there was none (H200 run 21 printed "ended by exited by itself").
    gone = REAPED._replace(ended_by="exited by itself", exit_s=0.01, release_s=0.15)
    assert terminal.reaped_lines(gone)[0] == (
        "  pid 4242 exited by itself after 0.01s (found as descendant, spawned by t.py::test_leaks): held "
        "GPU 0 512 MiB; the driver released it 0.15s after it ended")
    zombie = REAPED._replace(ended_by="reaped zombie", exit_s=None, release_s=None)
    assert terminal.reaped_lines(zombie)[0].startswith(
        "  pid 4242 had exited (a zombie: collected) (found as")


def test_check_report_lists_every_finding_then_the_devices() -> None:
    text = terminal.check_report(AFTER, "HEADING")
    assert text.splitlines() == [
        "HEADING",
        "reaped 1 process(es):",
        *terminal.reaped_lines(REAPED),
        "outlived the test, then ended by themselves:",
        *terminal.offender_lines(LEAKED),
        "still dirty after 1.50s:",
        "  leaked pid 4242 (user ci, sleeping, found as cookie, spawned by t.py::test_leaks): GPU 0 512 MiB; "
        "reaping is off",
        "      cmd: python -c 'hold()'",
        "  memory: 88 MiB used on GPU 0 beyond the tolerance",
        "note: a note",
        "devices (tolerance 16 MiB):",
        "  GPU 0 H200 (GPU-0000): 600/1000 MiB used, processes: pid 4242 512 MiB, pid 7",
    ]


@pytest.mark.parametrize(("reaped", "leaked", "reap_enabled", "heading"), [
    ((REAPED,), (), True, "gpuclean: test leaked 1 process(es) (reaped)"),
    ((REAPED,), (LEAKED,), True, "gpuclean: test leaked 2 process(es) (NOT all reaped)"),
    ((), (LEAKED,), False, "gpuclean: test leaked 1 process(es) (reaping is off: reported only)"),
    ((REAPED._replace(ended_by="reaped zombie"),), (), True,
     "gpuclean: test leaked 1 exited child(ren) nobody waited for (reaped)"),
    ((REAPED, REAPED._replace(ended_by="reaped zombie")), (), True,
     "gpuclean: test leaked 1 process(es) and 1 exited child(ren) nobody waited for (reaped)"),
])
def test_leak_heading_counts_live_processes_and_zombies_apart(
        reaped: tuple[Reaped, ...], leaked: tuple[Offender, ...], reap_enabled: bool, heading: str) -> None:
    assert terminal.leak_heading(reaped, leaked, reap_enabled) == heading


def test_totals_count_unchecked_leakers_apart_from_checked_tests() -> None:
    # An unchecked test has a record only because a later check found what it leaked.
    clean = Record("t.py::test_clean", before=BEFORE, after=BEFORE._replace(phase="teardown"))
    unchecked = Record("t.py::test_unmarked", found_later=(REAPED,))
    # At fault, so counted with findings as the JSON report's with_findings counts it, and named apart.
    assert terminal.totals_line([clean, unchecked], [REAPED]) == (
        "1 checked test(s), 1 with findings, 1 unchecked test(s) that leaked processes, 1 process(es) reaped")
    assert terminal.totals_line([clean, RECORD], []) == (
        "2 checked test(s), 1 with findings, 1 process(es) reaped")
    # A test that never got its GPU locks was not checked either.
    assert terminal.totals_line([clean, NO_LOCKS], []) == (
        "1 checked test(s), 0 with findings, 0 process(es) reaped, 1 gave up waiting for GPU locks")
    lines = terminal.summary_lines([clean, unchecked], [], ["a note"])
    assert lines == ["t.py::test_unmarked: leaked 1 process(es) found by a later check (pid 4242 SIGTERM)",
                     "a note", terminal.totals_line([clean, unchecked], [])]


def test_json_shapes_publish_the_words_and_the_survivor_state() -> None:
    assert jsonreport.reaped_json(SURVIVED)["ended_by"] == "survived (uninterruptible sleep (D))"
    record = jsonreport.record_json(RECORD)
    assert record["outcome"] == "leaked"
    assert [(p["pid"], p["found"], p["ended_by"]) for p in record["leaked"]] == [
        (4242, "teardown", "SIGTERM"), (4242, "later", "survived (uninterruptible sleep (D))"),
        (4242, "teardown", None), (4242, "teardown", "exited by itself")]
    assert record["in_process_mib"] == [{"device": "cuda:0", "mib": 1.5}]
    assert record["after"]["offenders"][1] == {
        "reason": "memory", "found_by": "gpu", "detail": "88 MiB used on GPU 0 beyond the tolerance",
        "process": None, "owner": None, "mib_per_device": [{"device": "GPU 0", "mib": 88.0}]}
    assert jsonreport.snapshot_json(SNAP)["processes"][1] == {"pid": 7, "used_bytes": None, "used_mib": None}
    # (REAPED after the test and SURVIVED found later are one process, counted once; the session's end
    # reaped another)
    assert jsonreport.summary_json([RECORD, NO_LOCKS, Record("t.py::test_unchecked")],
                                   [REAPED._replace(process=PROC._replace(pid=4343))]) == {
        "tests": 3, "checked": 1, "with_findings": 1, "clean": 0, "leaked": 1, "not_clean": 0, "gpu_fault": 0,
        "reaped": 2,
        "lock_timeouts": 1, "fixture_leaks": 0, "device_errors": 0, "dirty_from_outside": 0}
    assert jsonreport.outcome(FAULTED) == "gpu_fault"
    assert jsonreport.record_json(FAULTED)["health"] == [{
        "kind": "xid", "effect": "fault", "device": "GPU 0", "uuid": "GPU-0000", "phase": "teardown",
        "xid": 31, "message": "GPU 0: Xid 31 (MMU fault)"}]
    assert terminal.summary_lines([FAULTED], [], [])[0] == "t.py::test_faults: GPU 0: Xid 31 (MMU fault)"


def test_a_fixtures_leak_is_the_fixtures_in_every_output() -> None:
    # Found at test_d's teardown, which only pytest's order ties to it: the headline, the summary, the
    # JSON report, the JUnit properties and the annotation name the fixture; test_d stays clean.
    assert terminal.fixture_leak_heading(ENGINE_LEAK, True) == (
        "gpuclean: fixture engine (session-scoped, conftest.py:12) leaked 3 process(es) (NOT all reaped), "
        "found at the teardown of t2.py::test_d")
    assert terminal.summary_lines([FIXTURE_RECORD], [], []) == [
        "fixture engine (session-scoped, conftest.py:12), found at the teardown of t2.py::test_d: leaked 3 "
        "process(es) (pid 4242 SIGTERM, pid 4242 NOT reaped, pid 4242 exited by itself)",
        "1 checked test(s), 0 with findings, 1 fixture(s) that leaked processes, 1 process(es) reaped"]
    record = jsonreport.record_json(FIXTURE_RECORD)
    assert (record["outcome"], record["leaked"]) == ("clean", [])
    fixture = jsonreport.fixture_json(ENGINE_LEAK)
    assert {k: fixture[k] for k in ("name", "scope", "file", "line", "reported_on")} == {
        "name": "engine", "scope": "session", "file": "conftest.py", "line": 12,
        "reported_on": "t2.py::test_d"}
    assert [p["ended_by"] for p in fixture["leaked"]] == ["SIGTERM", None, "exited by itself"]
    summary = jsonreport.summary_json([FIXTURE_RECORD], [])
    assert (summary["leaked"], summary["fixture_leaks"], summary["reaped"]) == (0, 1, 1)
    properties = dict(ci.junit_properties(FIXTURE_RECORD))
    assert (properties["gpuclean_outcome"], properties["gpuclean_fixture_leaks"]) == (
        "clean", "fixture engine (session-scoped, conftest.py:12) leaked 3 process(es)")
    [annotation] = ci.annotation_lines([FIXTURE_RECORD], [])
    assert annotation.startswith("::error file=conftest.py,line=12,title=GPU leak::fixture engine "
                                 "(session-scoped, conftest.py:12) leaked 3 process(es), found at the "
                                 "teardown of t2.py::test_d%0Apid 4242 ended by SIGTERM")
    assert annotation.endswith("%0Apid 4242 exited by itself: python -c 'hold()'")


def test_a_check_that_could_not_read_a_device_is_counted_and_said_in_one_line() -> None:
    record = Record("t.py::test_leaks", ("t.py", 3), BEFORE, UNREADABLE)
    assert terminal.unreadable_heading(UNREADABLE) == (
        "gpuclean: could not check the GPUs after the test: GPU 1 (GPU-1111): simulated device file "
        "'/s/1/7' holds 'x'")
    assert terminal.totals_line([record], []) == (
        "1 checked test(s), 1 with findings, 1 process(es) reaped, 1 could not read a device")
    assert jsonreport.check_json(UNREADABLE)["error"] == UNREADABLE.error
    summary = jsonreport.summary_json([record], [])
    assert (summary["checked"], summary["leaked"], summary["device_errors"]) == (1, 1, 1)
    assert dict(ci.junit_properties(record))["gpuclean_device_error"] == UNREADABLE.error


def test_a_gpu_used_without_its_lock_is_the_finding_of_the_test_that_used_it() -> None:
    import jsonschema

    # Found by another xdist worker, in a record of its own: the controller folds it into the test's
    # record (from the worker that ran the test), which the same process also found later.
    found_later = Record("t.py::test_leaks", found_later=(REAPED,))
    victim = Record("t.py::test_victim", ("t.py", 3), BEFORE, SEEN_SIBLING)
    book = store.RecordStore()
    book.add_worker({"records": [to_dict(victim), to_dict(UNCHECKED_USER)],
                      "session_reaped": [], "notes": []})
    book.add_worker({"records": [to_dict(found_later)], "session_reaped": [], "notes": []})
    merged = book.merged()
    assert [r.nodeid for r in merged.records] == ["t.py::test_victim", "t.py::test_leaks"]
    assert merged.records[1].found_later == (REAPED,) and merged.records[1].gpu_without_lock == (SIBLING,)
    assert book.merged() == merged  # (folded anew for each output, nothing changed in place)
    assert not has_findings(merged.records[0]) and has_findings(merged.records[1])
    assert terminal.summary_lines(merged.records, [], [])[0] == (
        "t.py::test_leaks: leaked 1 process(es) found by a later check (pid 4242 SIGTERM); used a GPU whose "
        "lock another xdist worker's test held: pid 4242 GPU 0 512 MiB while gw1's t.py::test_victim held it")
    assert terminal.totals_line(merged.records, []) == (
        "1 checked test(s), 1 with findings, 1 unchecked test(s) that leaked processes, 1 process(es) "
        "reaped, 1 used a GPU another xdist worker held the lock of")
    # Alone, it is still a finding (an unchecked test that put memory on a locked GPU and leaked nothing).
    assert terminal.totals_line([UNCHECKED_USER], []).endswith(", 1 used a GPU another xdist worker held the "
                                                             "lock of")
    document = jsonreport.report_document(records=merged.records, session_reaped=[], notes=[], session={
        "start": "2026-12-01T00:00:00.000+00:00", "end": "2026-12-01T00:00:01.000+00:00", "duration_s": 1.0,
        "exitstatus": 0, "host": "h", "backend": "simulated", "driver": "simulated", "unavailable": None,
        "devices": [], "settings": {"all": False, "tolerance_mib": 0, "timeout": 60.0, "scope": "session",
                                    "reap": "on", "grace": 5.0, "lock": "on", "require_gpu": False},
        "xdist_workers": 2})
    jsonschema.validate(document, jsonreport.load_schema())
    assert document["summary"]["gpu_without_lock"] == 1 and document["summary"]["clean"] == 1
    assert document["tests"][1]["gpu_without_lock"] == [{
        "process": jsonreport.process_json(PROC), "owner": {"kind": "test", "name": "t.py::test_leaks"},
        "worker": "gw0", "mib_per_device": [{"device": "GPU 0", "mib": 512.0}],
        "lock_held_by": {"nodeid": "t.py::test_victim", "worker": "gw1", "phase": "teardown"}}]
    # Without one, a report keeps its old keys only.
    assert "gpu_without_lock" not in document["tests"][0]
    assert "gpu_without_lock" not in jsonreport.summary_json([victim], [])
    # A forked child ships it like what a later check found.
    child = store.RecordStore()
    child.record_for("t.py::test_leaks").gpu_without_lock += (SIBLING,)
    parent = store.RecordStore()
    parent.receive(json.loads(json.dumps(child.ship())))
    assert parent.record_for("t.py::test_leaks").gpu_without_lock == (SIBLING,)


def test_the_annotation_of_a_test_that_used_a_gpu_without_its_lock() -> None:
    from pytest_gpuclean.report import ci
    assert ci.annotation_message(UNCHECKED_USER) == (
        ci.TITLE_WITHOUT_LOCK,
        "t.py::test_leaks used a GPU whose lock another xdist worker's test held\n"
        "pid 4242 held GPU 0 512 MiB while gw1's t.py::test_victim held the GPU lock: python -c 'hold()'")
    title, message = ci.annotation_message(replace(UNCHECKED_USER, found_later=(REAPED,))) or ("", "")
    assert title == ci.TITLE_LEAK and message.splitlines()[2:] == [
        "and used a GPU whose lock another xdist worker's test held:",
        "pid 4242 held GPU 0 512 MiB while gw1's t.py::test_victim held the GPU lock: python -c 'hold()'"]


def _enum(schema: dict[str, Any], *path: str) -> set[Any]:
    node: Any = schema
    for key in path:
        node = node[key]
    return set(node["enum"])


def test_the_closed_sets_are_the_schema_enums() -> None:
    # The Literal types are what mypy checks; the schema is what consumers of the report check.
    defs = jsonreport.load_schema()["$defs"]
    assert set(get_args(model.Reason)) == _enum(defs, "offender", "properties", "reason")
    assert set(get_args(model.OwnerKind)) == _enum(defs["owner"]["oneOf"][1], "properties", "kind")
    session = defs["session"]["properties"]["settings"]["properties"]
    assert set(get_args(model.Scope)) == _enum(session, "scope")
    assert set(get_args(model.OnOff)) == _enum(session, "reap") == _enum(session, "lock")
    assert set(get_args(model.OutsideAction)) == _enum(session, "outside")
    assert set(get_args(model.OutsideAction)) | {None} == _enum(defs, "test", "properties", "outside_action")

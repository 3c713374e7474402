"""Formatting and serialisation of findings, in-process: text report, summary, JSON shapes, round trips."""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any, get_args

import pytest

from pytest_gpuclean import findings, jsonreport, model, ray_model, report
from pytest_gpuclean.findings import Offender, ProcessInfo, Reaped
from pytest_gpuclean.model import (
    MIB,
    CheckResult,
    DeviceInfo,
    DeviceSnapshot,
    GpuProcess,
    Outside,
    Owner,
)
from pytest_gpuclean.model import TestRecord as Record  # (a Test* name would be collected)
from pytest_gpuclean.ray_model import ClusterCheck, ClusterFinding, ClusterNode, ClusterReaped, NodeRelease
from pytest_gpuclean.serialize import (
    from_dict,
    reaped_from_dict,
    reaped_to_dict,
    record_from_dict,
    record_to_dict,
    to_dict,
)

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
RECORD = Record("t.py::test_leaks", ("t.py", 12), BEFORE, AFTER, [SURVIVED], [("cuda:0", 1.5)],
                ("GPU-0000",), lock_wait_s=0.5, before_s=0.01, after_s=1.5)
NO_LOCKS = Record("t.py::test_waits", ("t.py", 20), lock_wait_s=600.0,
                  lock_timeout="waited 600s for 1 of 1 GPU lock(s); held by: GPU-0000: pid 1")

OUTSIDE = Outside((("GPU 0", 88.0),), only=True, same_as="t.py::test_leaks")
OUTSIDE_CHECK = CheckResult("setup", False, (SNAP,), (MEMORY,), waited_s=0.01, tolerance_mib=16,
                            outside=OUTSIDE)
OUTSIDE_RECORD = Record("t.py::test_skipped", ("t.py", 40), OUTSIDE_CHECK, outside_action="skip")

NODE = "3f2a9c1b" + "0" * 48
RAY_SNAP = DeviceSnapshot(DeviceInfo(0, "GPU-0000", f"node {NODE[:8]}: H200"), 600 * MIB, 1000 * MIB,
                          (GpuProcess(4242, 512 * MIB),))
RAY_REAPED = ClusterReaped(NODE, "ray.kill", dataclasses.replace(REAPED, ended_by="exited by itself"),
                           actor_id="a" * 32, job_id="01000000")
RAY_LADDER = ClusterReaped(NODE, "ladder", REAPED, job_id="01000000")
RAY_RELEASE = NodeRelease(NODE, 0.41, (4242,))
RAY_AFTER = ClusterCheck("127.0.0.1:6379", "teardown", False, (ClusterNode(NODE, (RAY_SNAP,), ""),),
                         (ClusterFinding(NODE, LEAKED),), (RAY_REAPED, RAY_LADDER), (RAY_RELEASE,), 0.5,
                         ("a note",))
RAY_BEFORE = ClusterCheck("127.0.0.1:6379", "setup", True, (ClusterNode(NODE, (), "devices unreadable"),))
RAY_RECORD = Record("t.py::test_ray", ("t.py", 30), BEFORE, BEFORE, cluster_before=RAY_BEFORE,
                    cluster_after=RAY_AFTER)

# One fully populated instance of every dataclass in model, findings and ray_model: each must survive a
# round trip.
EXAMPLES: list[Any] = [GPU0, MIG, PROC, TEST, SNAP, GpuProcess(1, None), REAPED, SURVIVED, LEAKED, MEMORY,
                       AFTER, BEFORE, RECORD, NO_LOCKS, Record("t.py::test_unchecked"), RAY_REAPED,
                       RAY_RELEASE, ClusterNode(NODE, (RAY_SNAP,), "x"), ClusterFinding("", MEMORY),
                       RAY_AFTER, RAY_RECORD, OUTSIDE, OUTSIDE_CHECK, OUTSIDE_RECORD]


def test_cluster_findings_in_the_summary_and_the_json_report() -> None:
    import jsonschema

    lines = report.summary_lines([RAY_RECORD], [], [])
    assert lines[0] == (f"t.py::test_ray: Ray teardown on node {NODE[:8]}: reaped pid 4242 by ray.kill, "
                        "pid 4242 SIGTERM, devices released in 0.41s, not clean (leaked pid 4242)")
    assert lines[-1] == "1 checked test(s), 1 with findings, 2 process(es) reaped"
    document = jsonreport.report_document(records=[RAY_RECORD], session_reaped=[], notes=[], session={
        "start": "2026-12-01T00:00:00.000+00:00", "end": "2026-12-01T00:00:01.000+00:00", "duration_s": 1.0,
        "exitstatus": 1, "host": "h", "backend": "simulated", "driver": "simulated", "unavailable": None,
        "devices": [], "settings": {"all": False, "tolerance_mib": 0, "timeout": 60.0, "scope": "session",
                                    "reap": "on", "grace": 5.0, "lock": "on", "require_gpu": False},
        "xdist_workers": None, "ray": jsonreport.ray_json("127.0.0.1:6379", "2.60.0", [RAY_AFTER])})
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
    # Without a cluster, a test's record keeps its old keys only.
    assert "cluster_after" not in jsonreport.record_json(RECORD)


def test_every_record_class_has_a_round_trip_example() -> None:
    classes = {cls for module in (model, findings, ray_model)
               for _, cls in inspect.getmembers(module, inspect.isclass)
               if (dataclasses.is_dataclass(cls) or issubclass(cls, model.Fields))
               and cls.__module__ == module.__name__ and cls is not model.Fields}
    assert classes == {type(e) for e in EXAMPLES}


def test_records_compare_hash_and_copy_by_their_fields() -> None:
    device = model.DeviceInfo(0, "GPU-a", "H200")
    same = model.DeviceInfo(0, "GPU-a", "H200")
    assert device == same and hash(device) == hash(same) and device is not same
    assert device != device.replace(mig_index=1) and device != model.GpuProcess(0, None)
    assert {device: 1}[same] == 1
    assert repr(device) == "DeviceInfo(index=0, uuid='GPU-a', name='H200', mig_index=None)"
    assert model.Owner("test", "t").replace(kind="fixture") == model.Owner("fixture", "t")
    with pytest.raises(TypeError):
        hash(Record("t.py::test"))  # filled in as the test runs: no hash, as a mutable dataclass


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: type(e).__name__)
def test_round_trip_through_json_gives_an_equal_object(example: Any) -> None:
    data = json.loads(json.dumps(to_dict(example)))
    assert from_dict(type(example), data) == example


def test_a_record_keeps_its_sequence_types() -> None:
    back = record_from_dict(json.loads(json.dumps(record_to_dict(RECORD))))
    assert isinstance(back.in_process_mib, list) and back.in_process_mib[0] == ("cuda:0", 1.5)
    assert isinstance(back.found_later, list) and isinstance(back.devices, tuple)
    assert back.after is not None and isinstance(back.after.offenders[0].mib_per_device[0], tuple)


def test_a_reaped_process_round_trips_alone() -> None:
    # How a forked child ships what a later check found (records.SessionRecords.receive): the one path
    # that names Reaped at run time in serialize (CI's pytest-8 forked run caught it unloaded).
    assert reaped_from_dict(json.loads(json.dumps(reaped_to_dict(REAPED)))) == REAPED


def test_reaped_lines_show_how_and_when() -> None:
    assert report.reaped_lines(REAPED) == [
        "  pid 4242 ended by SIGTERM after 0.25s (found as descendant, spawned by t.py::test_leaks): held "
        "GPU 0 512 MiB; the driver released it 0.12s after the SIGTERM",
        "      cmd: python -c 'hold()'"]
    assert report.reaped_lines(SURVIVED)[0] == (
        "  pid 4242 survived SIGKILL (uninterruptible sleep (D)) (found as adopted, spawned by "
        "t.py::test_leaks): held no GPU memory")


def test_a_process_no_signal_ended_reads_as_such() -> None:
    # A Ray actor's worker ended through ray.kill, or a leak that exited while the check waited: "ended by"
    # names a signal, and there was none (H200 run 21 printed "ended by exited by itself").
    gone = dataclasses.replace(REAPED, ended_by="exited by itself", exit_s=0.01, release_s=0.15)
    assert report.reaped_lines(gone)[0] == (
        "  pid 4242 exited by itself after 0.01s (found as descendant, spawned by t.py::test_leaks): held "
        "GPU 0 512 MiB; the driver released it 0.15s after it ended")
    zombie = dataclasses.replace(REAPED, ended_by="reaped zombie", exit_s=None, release_s=None)
    assert report.reaped_lines(zombie)[0].startswith("  pid 4242 had exited (a zombie: collected) (found as")


def test_check_report_lists_every_finding_then_the_devices() -> None:
    text = report.check_report(AFTER, "HEADING")
    assert text.splitlines() == [
        "HEADING",
        "reaped 1 process(es):",
        *report.reaped_lines(REAPED),
        "outlived the test, then ended by themselves:",
        *report.offender_lines(LEAKED),
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
    ((dataclasses.replace(REAPED, ended_by="reaped zombie"),), (), True,
     "gpuclean: test leaked 1 exited child(ren) nobody waited for (reaped)"),
    ((REAPED, dataclasses.replace(REAPED, ended_by="reaped zombie")), (), True,
     "gpuclean: test leaked 1 process(es) and 1 exited child(ren) nobody waited for (reaped)"),
])
def test_leak_heading_counts_live_processes_and_zombies_apart(
        reaped: tuple[Reaped, ...], leaked: tuple[Offender, ...], reap_enabled: bool, heading: str) -> None:
    assert report.leak_heading(reaped, leaked, reap_enabled) == heading


def test_totals_count_unchecked_leakers_apart_from_checked_tests() -> None:
    # An unchecked test has a record only because a later check found what it leaked.
    clean = Record("t.py::test_clean", before=BEFORE, after=BEFORE.replace(phase="teardown"))
    unchecked = Record("t.py::test_unmarked", found_later=[REAPED])
    assert report.totals_line([clean, unchecked], [REAPED]) == (
        "1 checked test(s), 0 with findings, 1 unchecked test(s) that leaked processes, 1 process(es) reaped")
    assert report.totals_line([clean, RECORD], []) == (
        "2 checked test(s), 1 with findings, 1 process(es) reaped")
    # A test that never got its GPU locks was not checked either.
    assert report.totals_line([clean, NO_LOCKS], []) == (
        "1 checked test(s), 0 with findings, 0 process(es) reaped, 1 gave up waiting for GPU locks")
    lines = report.summary_lines([clean, unchecked], [], ["a note"])
    assert lines == ["t.py::test_unmarked: leaked 1 process(es) found by a later check (pid 4242 SIGTERM)",
                     "a note", report.totals_line([clean, unchecked], [])]


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
    assert jsonreport.summary_json([RECORD, NO_LOCKS, Record("t.py::test_unchecked")], [REAPED]) == {
        "tests": 3, "checked": 1, "clean": 0, "leaked": 1, "not_clean": 0, "reaped": 2, "lock_timeouts": 1,
        "dirty_from_outside": 0}


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

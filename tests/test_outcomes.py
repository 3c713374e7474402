"""The decisions over plain records, unit-tested without processes (as xdist's test_dsession.py drives its
schedulers with MockNodes): whose a reaped process is (``outcomes.split_own``), what a test's outcome is
(``outcomes.outcome``, ``outcomes.has_findings``, ``outcomes.own_leaks``), which every output uses, and what
``gpuclean reap`` may end on this host or a Ray cluster (``reap_plan.plan``).
"""

from __future__ import annotations

import pytest

from pytest_gpuclean._check import reap_plan
from pytest_gpuclean._check.reap_plan import plan as plan_reap
from pytest_gpuclean._model.outcomes import (
    ALL_KINDS,
    has_findings,
    noticed,
    outcome,
    own_leaks,
    reaped_count,
    split_own,
)
from pytest_gpuclean._model.records import (
    CheckResult,
    ClusterReading,
    Credentials,
    FixtureLeak,
    FoundBy,
    HealthFinding,
    NodeReading,
    Offender,
    Owner,
    OwnerKind,
    ProcessInfo,
    Reaped,
)
from pytest_gpuclean._model.records import TestRecord as Record
from pytest_gpuclean.report import ci, jsonreport, terminal

NODEID = "t.py::test_it"
ME = Owner("test", NODEID)
EARLIER = Owner("test", "t.py::test_earlier")
MY_FIXTURE = Owner("fixture", "engine (module-scoped)")
SESSION_FIXTURE = Owner("fixture", "server (session-scoped)")
SESSION = Owner("session", "conftest")
NODE = "n" * 56
PROC = ProcessInfo(pid=4242, start_ticks=99, ppid=1, uid=1000, user="ci", cmdline="sleep 600",
                   state="sleeping")


def reaped(owner: Owner | None, found_by: FoundBy = "descendant") -> Reaped:
    return Reaped(PROC, owner, found_by, "SIGTERM", (("GPU 0", 64.0),), 0.01, 0.02)


def leaked(owner: Owner | None, process: ProcessInfo | None = PROC) -> Offender:
    return Offender("leaked", process, owner, "cookie", (("GPU 0", 64.0),), "reaping is off")


MEMORY = Offender("memory", None, None, "gpu", (("GPU 0", 88.0),),
                  "88 MiB used on GPU 0 beyond the tolerance")
CLEAN_BEFORE = CheckResult("setup", True, (), ())
CLEAN_AFTER = CheckResult("teardown", True, (), ())


def after(**fields: object) -> CheckResult:
    return CLEAN_AFTER._replace(**fields)


def health(effect: str) -> HealthFinding:
    return HealthFinding("xid", effect, "GPU 0", "GPU-0000", f"GPU 0: Xid ({effect})", "teardown", 31)


def cluster(clean: bool = True, reaped_: tuple[Reaped, ...] = (),
            findings: tuple[Offender, ...] = ()) -> CheckResult:
    """A Ray cluster's check: an ordinary check result whose findings name their node."""
    return CheckResult("teardown", clean, (), findings, reaped_,
                       cluster=ClusterReading("127.0.0.1:6379", (NodeReading(NODE, (), ""),)))


def on_node(found: Reaped | Offender, node: str = NODE, **fields: object) -> Reaped | Offender:
    return found._replace(node=node, **fields)


UNREACHABLE = Offender("unreachable", None, None, "gpu", detail="the Ray cluster at 127.0.0.1:6379 did not "
                       "answer (census) within 5s", node="")


FIXTURE_LEAK = FixtureLeak("engine", "module", ("conftest.py", 3), NODEID, (reaped(MY_FIXTURE),))

# (name, record, outcome, has findings)
OUTCOMES: list[tuple[str, Record, str, bool]] = [
    ("clean", Record(NODEID, before=CLEAN_BEFORE, after=CLEAN_AFTER), "clean", False),
    ("unchecked: no check finished", Record(NODEID), "unchecked", False),
    ("unchecked: lock timeout: noticed, not a finding",
     Record(NODEID, lock_timeout="waited 1s"), "unchecked", False),
    ("leaked: own process reaped after it",
     Record(NODEID, before=CLEAN_BEFORE, after=after(reaped=(reaped(ME),))), "leaked", True),
    ("leaked: unknown owner reaped after it is the finder's",
     Record(NODEID, before=CLEAN_BEFORE, after=after(reaped=(reaped(None),))), "leaked", True),
    ("leaked: still running (reaping off)",
     Record(NODEID, before=CLEAN_BEFORE, after=after(clean=False, offenders=(leaked(ME),))), "leaked",
     True),
    ("leaked: exited by itself while the check waited",
     Record(NODEID, before=CLEAN_BEFORE, after=after(lingered=(leaked(ME),))), "leaked", True),
    ("leaked: found by a later check (the test was not checked)",
     Record(NODEID, found_later=(reaped(ME),)), "leaked", True),
    ("leaked: left on the Ray cluster",
     Record(NODEID, before=CLEAN_BEFORE, after=CLEAN_AFTER,
                cluster_after=cluster(reaped_=(on_node(reaped(ME), via="ray.kill"),))), "leaked",
     True),
    ("leaked: still on the Ray cluster",
     Record(NODEID, before=CLEAN_BEFORE, after=CLEAN_AFTER,
                cluster_after=cluster(False, findings=(on_node(leaked(ME)),))), "leaked", True),
    ("an earlier test's leftover reaped after it: noticed, not a finding",
     Record(NODEID, before=CLEAN_BEFORE, after=after(reaped=(reaped(EARLIER),))), "clean", False),
    ("an earlier test's leftover reaped before it: noticed, not a finding",
     Record(NODEID, before=CLEAN_BEFORE._replace(reaped=(reaped(EARLIER),)), after=CLEAN_AFTER), "clean",
     False),
    ("an earlier test's leftover still there: not clean, not its leak",
     Record(NODEID, before=CLEAN_BEFORE, after=after(clean=False, offenders=(leaked(EARLIER),))),
     "not_clean", True),
    ("a leak with no process to name: not clean",
     Record(NODEID, before=CLEAN_BEFORE, after=after(clean=False, offenders=(leaked(ME, None),))),
     "not_clean", True),
    ("a fixture's leak is the fixture's, not the test's",
     Record(NODEID, before=CLEAN_BEFORE, after=CLEAN_AFTER, fixture_leaks=(FIXTURE_LEAK,)), "clean",
     False),
    ("not clean before", Record(NODEID, before=CLEAN_BEFORE._replace(clean=False, offenders=(MEMORY,))),
     "not_clean", True),
    ("not clean after",
     Record(NODEID, before=CLEAN_BEFORE, after=after(clean=False, offenders=(MEMORY,))), "not_clean",
     True),
    ("device error (nothing reaped)",
     Record(NODEID, before=CLEAN_BEFORE, after=after(clean=False, error="GPU 0: lost", device_lost=True)),
     "not_clean", True),
    ("device error, its own process reaped all the same",
     Record(NODEID, before=CLEAN_BEFORE, after=after(clean=False, error="GPU 0: lost",
                                                         reaped=(reaped(ME),))), "leaked", True),
    ("the Ray cluster not clean",
     Record(NODEID, before=CLEAN_BEFORE, after=CLEAN_AFTER, cluster_after=cluster(False)), "not_clean",
     True),
    ("the Ray cluster could not be reached before the test: not clean, no leak",
     Record(NODEID, cluster_before=(cluster(False, findings=(UNREACHABLE,)))._replace(phase="setup")),
     "not_clean", True),
    ("the Ray cluster could not be reached after the test: not clean, no leak",
     Record(NODEID, before=CLEAN_BEFORE, after=CLEAN_AFTER,
            cluster_after=cluster(False, findings=(UNREACHABLE,))),
     "not_clean", True),
    ("health: a GPU that needs a reset",
     Record(NODEID, before=CLEAN_BEFORE, after=CLEAN_AFTER, health=(health("unusable"),)), "not_clean",
     True),
    ("health: a lost GPU",
     Record(NODEID, before=CLEAN_BEFORE, after=CLEAN_AFTER, health=(health("lost"),)), "not_clean", True),
    ("health: an Xid the test caused",
     Record(NODEID, before=CLEAN_BEFORE, after=CLEAN_AFTER, health=(health("fault"),)), "gpu_fault", True),
    ("health: information only",
     Record(NODEID, before=CLEAN_BEFORE, after=CLEAN_AFTER, health=(health("info"),)), "clean", False),
    ("an earlier test's process ended by itself while the check waited: noticed, clean",
     Record(NODEID, before=CLEAN_BEFORE, after=after(lingered=(leaked(EARLIER),))), "clean", False),
    ("a zombie collected: noticed, clean",
     Record(NODEID, before=CLEAN_BEFORE, after=after(collected=(reaped(ME),))), "clean", False),
    ("a session fixture's process that exited by itself during the test: noticed, clean",
     Record(NODEID, before=CLEAN_BEFORE, after=after(collected=(reaped(SESSION_FIXTURE),))), "clean",
     False),
    ("torch memory grew in-process: a finding, clean",
     Record(NODEID, before=CLEAN_BEFORE, after=CLEAN_AFTER, in_process_mib=(("cuda:0", 2.0),)), "clean",
     True),
    ("dirty from outside, skipped",
     Record(NODEID, before=CLEAN_BEFORE._replace(clean=False, offenders=(MEMORY,)), outside_action="skip"),
     "not_clean", True),
]


OUTCOME_NAMES = {id(row[1]): row[0] for row in OUTCOMES}


@pytest.mark.parametrize(("record", "expected", "findings"), [row[1:] for row in OUTCOMES],
                         ids=[row[0] for row in OUTCOMES])
def test_outcome(record: Record, expected: str, findings: bool) -> None:
    assert outcome(record) == expected
    assert has_findings(record) is findings
    # Every output asks the same function: the JSON, the record's properties, the JUnit properties.
    assert jsonreport.outcome(record) == expected
    assert jsonreport.record_json(record)["outcome"] == expected
    assert has_findings(record) is findings
    assert own_leaks(record).any() is (expected == "leaked") is bool(jsonreport.leaked_json(record))
    assert ("gpuclean_outcome", expected) in ci.junit_properties(record)
    assert jsonreport.record_json(record)["findings"] is findings
    # Every outcome but clean is the test's finding; a clean one only by a finding of its own that does not
    # fail it (torch memory grown, a GPU used without its lock). What its checks did for others is noticed.
    assert findings is (expected not in ("clean", "unchecked") or bool(record.in_process_mib))
    victim = "noticed" in OUTCOME_NAMES[id(record)]
    assert noticed(record) is victim


def test_totals_count_what_outcome_decides() -> None:
    """The summary's totals and the JSON summary agree with ``outcome`` over the same records."""
    records = [row[1] for row in OUTCOMES]
    summary = jsonreport.summary_json(records, [])
    decided = [outcome(r) for r in records]
    assert summary["with_findings"] == sum(1 for r in records if has_findings(r))
    for key in ("clean", "leaked", "not_clean", "gpu_fault"):
        assert summary[key] == decided.count(key)
    checked = [r for r in records if r.before is not None]
    unchecked_leaked = sum(1 for r in records if r.before is None and outcome(r) == "leaked")
    assert terminal.totals_line(records, []).startswith(
        f"{len(checked)} checked test(s), {sum(1 for r in records if has_findings(r))} with findings, "
        f"1 fixture(s) that leaked processes, {unchecked_leaked} unchecked test(s) that leaked processes, ")


def test_reaped_count_counts_each_process_where_it_was_ended() -> None:
    # By the check before or after a test, on the Ray cluster, with a fixture, by an xdist controller for a
    # worker that died (found_later only), at the session's end; each process once, by its identity: a leak
    # found by a later check is in that check's reaped and in its test's found_later.
    def ended(pid: int, owner: Owner, node: str | None = None) -> Reaped:
        return (reaped(owner))._replace(process=PROC._replace(pid=pid), node=node)

    earlier = ended(1, EARLIER)
    record = Record(NODEID, before=CLEAN_BEFORE._replace(reaped=(earlier,)),
                    after=after(reaped=(ended(2, ME), ended(3, ME))),
                    cluster_before=cluster(reaped_=(ended(1, EARLIER, NODE),)),
                    cluster_after=cluster(reaped_=(ended(4, ME, NODE),)),
                    fixture_leaks=(FIXTURE_LEAK._replace(reaped=(ended(5, MY_FIXTURE),)),),
                    found_later=(ended(6, ME),))
    found_earlier = Record("t.py::test_earlier", found_later=(earlier,))
    records, session_reaped = [record, found_earlier, Record("t.py::test_unchecked")], [ended(7, SESSION)]
    # pid 1 on this host and pid 1 on a Ray node are two processes; the earlier test's found_later is pid 1
    # of this host's check before.
    assert reaped_count(records, session_reaped) == 1 + 2 + 1 + 1 + 1 + 1 + 1
    # The summary line and the JSON report ask it, so they agree.
    assert jsonreport.summary_json(records, session_reaped)["reaped"] == 8
    assert ", 8 process(es) reaped" in terminal.totals_line(records, session_reaped)


def test_own_leaks_lists_each_place_in_report_order() -> None:
    lingering = leaked(ME)
    record = Record(NODEID, before=CLEAN_BEFORE,
                        after=after(clean=False, reaped=(reaped(ME), reaped(EARLIER)),
                                    offenders=(leaked(ME), leaked(EARLIER), leaked(ME, None), MEMORY),
                                    lingered=(lingering,)),
                        found_later=(reaped(ME, "cookie"),))
    leaks = own_leaks(record)
    assert leaks.reaped == [reaped(ME)]
    assert leaks.later == [reaped(ME, "cookie")]
    assert leaks.offenders == [(leaked(ME), None), (lingering, "exited by itself")]
    assert leaks.cluster_reaped == [] and leaks.cluster_left == []
    found = [e["found"] for e in jsonreport.leaked_json(record)]
    assert found == ["teardown", "later", "teardown", "teardown"]


# ---- whose a reaped process is ----------------------------------------------------------------------

TOKENS = {"tok-me": ME, "tok-fixture": MY_FIXTURE, "tok-earlier": EARLIER, "tok-session": SESSION}
OWN_TOKENS = {"tok-me", "tok-fixture"}


def by_token(owner: Owner) -> bool:
    """What the checks pass: the owner's registered token is the test's or a fixture's ending with it."""
    return next((t for t, o in TOKENS.items() if o is owner), None) in OWN_TOKENS


# (name, owner, found_by, judged kinds, own?)
WHOSE: list[tuple[str, Owner | None, FoundBy, tuple[OwnerKind, ...], bool]] = [
    ("the test's own", ME, "descendant", ("test", "fixture"), True),
    ("a fixture ending with the test", MY_FIXTURE, "cookie", ("test", "fixture"), True),
    ("an earlier test's", EARLIER, "cookie", ("test", "fixture"), False),
    ("an equal owner that is not the registered one (a rerun's)", Owner("test", NODEID), "cookie",
     ("test", "fixture"), False),
    ("unknown owner: the finder's", None, "gpu", ("test", "fixture"), True),
    ("the session's, not judged locally: the finder's", SESSION, "descendant", ("test", "fixture"), True),
    ("a dead session's debris, even with the test's owner", ME, "dead session", ("test", "fixture"), False),
    ("on a Ray cluster, the session's is judged: not the test's", SESSION, "gpu", ALL_KINDS, False),
    ("on a Ray cluster, the test's own", ME, "gpu", ALL_KINDS, True),
    ("on a Ray cluster, an unknown owner is the finder's", None, "gpu", ALL_KINDS, True),
]


@pytest.mark.parametrize(("owner", "found_by", "judged", "own"), [row[1:] for row in WHOSE],
                         ids=[row[0] for row in WHOSE])
def test_split_own(owner: Owner | None, found_by: FoundBy, judged: tuple[OwnerKind, ...], own: bool) -> None:
    item = reaped(owner, found_by)
    assert split_own([item], by_token, judged) == (([item], []) if own else ([], [item]))


def test_split_own_keeps_order_and_every_item() -> None:
    items = [reaped(EARLIER), reaped(ME), reaped(None, "gpu"), reaped(ME, "dead session"), reaped(MY_FIXTURE)]
    own, earlier = split_own(items, by_token)
    assert own == [items[1], items[2], items[4]]
    assert earlier == [items[0], items[3]]


def test_split_own_by_name_for_a_record_without_tokens() -> None:
    """A record read back (an xdist worker's) has no tokens: the reports tell the test's own by its name,
    and list a dead session's offender as the reports always did."""
    items = [leaked(EARLIER), leaked(ME), leaked(MY_FIXTURE), (leaked(ME))._replace(found_by="dead session")]
    own, earlier = split_own(items, lambda o: o.name == NODEID, ("test",), dead_sessions_theirs=False)
    assert own == items[1:]
    assert earlier == items[:1]


# ---- what `gpuclean reap` may end, on this host and on a Ray cluster -----------------------------------

MINE = PROC._replace(cmdline="python hold.py\n--mib 64")
ROOTS = PROC._replace(uid=0, user="root", cmdline="python serve.py")
THEIRS = PROC._replace(pid=4243, uid=1001, user="victim", cmdline="python3 logsig.py")
CI_ONLY = Credentials(4242, ((1000, "ci"),))
SETUID_ROOT = Credentials(4242, ((0, "root"), (1000, "ci")))
RELAY = Credentials(4242, ((1000, "ci"),), (THEIRS,))
ON_GPU0 = (("GPU 0", 64.0),)
NODE_A = "node aaaaaaaa"


def cand(**facts: object) -> reap_plan.ReapCandidate:
    fields: dict[str, object] = {"pid": 4242, "info": MINE, "mib": ON_GPU0}
    fields.update(facts)
    return reap_plan.ReapCandidate(**fields)  # type: ignore[arg-type]


NOT_VISIBLE_HERE = "pid 4242 (listed on GPU 0): not visible here (exited, or in another PID namespace)"
# (name, candidate, all users, the line it gets; None: a target, "": left alone without a line)
REAP: list[tuple[str, reap_plan.ReapCandidate, bool, str | None]] = [
    ("this host: the user's process on a GPU", cand(), False, None),
    ("this host: not visible", cand(info=None), False, NOT_VISIBLE_HERE),
    ("this host: a cookie carrier that exited is simply gone", cand(info=None, found_by="cookie"), False, ""),
    ("this host: a host pid the driver lists, an unrelated local process", cand(no_device_file=True), False,
     "pid 4242 (listed on GPU 0) is 'python hold.py --mib 64' here, which has no /dev/nvidia* open: not the "
     "driver's process (another PID namespace?)"),
    ("this host: gpuclean itself", cand(gpuclean_itself=True), False,
     "pid 4242 (python hold.py --mib 64): gpuclean itself or one of its ancestors"),
    ("this host: gpuclean itself carrying the cookie", cand(gpuclean_itself=True, found_by="cookie"), False,
     "pid 4242 (python hold.py --mib 64): carries the cookie, but is gpuclean itself or one of its "
     "ancestors"),
    ("this host: another user's", cand(info=ROOTS), False,
     "pid 4242 of user root (python serve.py): another user's process (only root, with --all-users, ends "
     "those)"),
    ("this host: another user's, with --all-users", cand(info=ROOTS), True, None),
    ("this host: the gate lets it through", cand(found_by="cookie", credentials=CI_ONLY), False, None),
    ("this host: another user's by its effective uid (a setuid program)",
     cand(found_by="cookie", credentials=SETUID_ROOT), False,
     "pid 4242 of user ci (python hold.py --mib 64): another user's process (it runs as root too) (only "
     "root, with --all-users, ends those)"),
    ("this host: a relay to another user (runuser, su)", cand(found_by="dead session", credentials=RELAY),
     False, "pid 4242 of user ci (python hold.py --mib 64): a signal to it may be relayed to pid 4243 of "
     "user victim (python3 logsig.py), its descendant: su, sudo and runuser pass signals on (only root, "
     "with --all-users, ends those)"),
    ("this host: a relay, with --all-users", cand(found_by="cookie", credentials=RELAY), True, None),
    ("cluster: the user's leftover of a finished job", cand(where=NODE_A, job_id="04"), False, None),
    ("cluster: not visible on its node", cand(info=None, where=NODE_A), False,
     "node aaaaaaaa: pid 4242: not visible on its node (exited, or another PID namespace)"),
    ("cluster: Ray's own, whoever runs it", cand(info=ROOTS, where=NODE_A, ray_own=True), False,
     "node aaaaaaaa: pid 4242 (python serve.py): Ray's own (daemon or task worker)"),
    ("cluster: another user's", cand(info=ROOTS, where=NODE_A), False,
     "node aaaaaaaa: pid 4242 of user root (python serve.py): another user's process"),
    ("cluster: its job still running, the driver known",
     cand(where=NODE_A, job_id="03", job_running=True, job_driver_pid=13), False,
     "node aaaaaaaa: pid 4242 (python hold.py --mib 64): its Ray job 03 is still running (driver pid 13)"),
    ("cluster: its job still running, unknown to the cluster",
     cand(where=NODE_A, job_id="05", job_running=True), False,
     "node aaaaaaaa: pid 4242 (python hold.py --mib 64): its Ray job 05 is still running"),
    ("cluster: a task worker", cand(where=NODE_A, job_id="04", task_worker=True), False,
     "node aaaaaaaa: pid 4242 (python hold.py --mib 64): a task worker of job 04: Ray ends it"),
]


@pytest.mark.parametrize(("candidate", "all_users", "line"), [row[1:] for row in REAP],
                         ids=[row[0] for row in REAP])
def test_reap_plan(candidate: reap_plan.ReapCandidate, all_users: bool, line: str | None) -> None:
    targets, left = plan_reap([candidate], my_uid=PROC.uid, all_users=all_users, cmd_width=80)
    assert targets == ([candidate] if line is None else [])
    assert left == ([line] if line else [])


def test_reap_plan_considers_a_pid_once_per_place() -> None:
    # A pid listed on a device is a target as such; the same pid carrying the cookie is not a second one.
    # One left alone as listed (a host pid's namesake) is still a target as a cookie carrier; the same pid
    # on two nodes is two processes.
    listed, carrier = cand(pid=1), cand(pid=1, found_by="cookie")
    namesake, namesake_carrier = cand(pid=2, no_device_file=True), cand(pid=2, found_by="cookie")
    node_a, node_b = cand(pid=3, where=NODE_A), cand(pid=3, where="node bbbbbbbb")
    targets, left = plan_reap([listed, carrier, namesake, namesake_carrier, node_a, node_b],
                              my_uid=PROC.uid, cmd_width=80)
    assert targets == [listed, namesake_carrier, node_a, node_b]
    assert len(left) == 1 and left[0].startswith("pid 2 (listed on GPU 0) is ")
    # Another user's process listed on a device and carrying the cookie: left alone, said once.
    theirs = THEIRS._replace(pid=5)
    _, left = plan_reap([cand(pid=5, info=theirs), cand(pid=5, info=theirs, found_by="cookie")],
                        my_uid=PROC.uid, cmd_width=80)
    assert left == ["pid 5 of user victim (python3 logsig.py): another user's process (only root, with "
                    "--all-users, ends those)"]


def test_reap_plan_cuts_command_lines_at_the_width() -> None:
    _, [line] = plan_reap([cand(gpuclean_itself=True, info=MINE._replace(cmdline="x" * 300))],
                          my_uid=PROC.uid, cmd_width=20)
    assert len(line.split("(", 1)[1].split(")", 1)[0]) <= 20


# ---- what a Ray cluster's check finds: ordinary findings that name their node -----------------------------

def test_an_unreachable_cluster_is_its_own_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster that does not answer is ``unreachable`` (for the whole cluster: node ''), not memory; the
    check is an ordinary ``CheckResult`` whose JSON the schema takes."""
    import jsonschema

    from pytest_gpuclean._ownership.evidence import Ownership
    from pytest_gpuclean.ray import cluster as ray_cluster
    from pytest_gpuclean.ray import reporting as ray_reporting

    def no_answer(*args: object, **kwargs: object) -> None:
        raise ray_cluster.ClusterError("the Ray cluster at 127.0.0.1:6379 did not answer (census) within 5s")

    check = ray_cluster.ClusterChecker("127.0.0.1:6379", Ownership("t"))
    monkeypatch.setattr(check, "_call", no_answer)
    result = check.check_cluster("teardown", tolerance_mib=0, timeout=5.0)
    assert not result.clean and result.cluster is not None and result.cluster.address == "127.0.0.1:6379"
    assert [(o.reason, o.node, o.process) for o in result.offenders] == [("unreachable", "", None)]
    assert check.sweep(include_session=True, timeout=5.0).offenders[0].reason == "unreachable"
    record = Record(NODEID, before=CLEAN_BEFORE, after=CLEAN_AFTER, cluster_after=result)
    assert outcome(record) == "not_clean" and not jsonreport.leaked_json(record)
    document = jsonreport.record_json(record, ray_reporting.record_keys)
    assert document["cluster_after"]["findings"][0]["reason"] == "unreachable"
    jsonschema.validate(document, {"$defs": jsonreport.load_schema()["$defs"], "$ref": "#/$defs/test"})
    assert ("unreachable: the Ray cluster at 127.0.0.1:6379 did not answer"
            in terminal.check_report(result, "x"))


def test_a_dead_or_unreadable_node_is_unreachable_and_named() -> None:
    from pytest_gpuclean.ray import cluster as ray_cluster
    from pytest_gpuclean.ray.messages import Census, NodeReport
    census = Census(nodes=(NodeReport("b" * 56, 0, (), (), "probe failed: boom"),),
                    dead_nodes=(("a" * 56, "node crashed"),), actors=(), our_jobs=(), took_s=0.1)
    found = ray_cluster.node_findings(census, 0, set())
    assert [(o.reason, o.node) for o in found] == [("unreachable", "a" * 56), ("unreachable", "b" * 56)]
    assert "Ray node aaaaaaaa died: node crashed" in found[0].detail

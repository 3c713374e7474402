"""The comparison of third-party suites run plain and under ``--gpuclean-all`` (run_suites.sh), in one file.

    python benchmarks/peers/suites_summary.py --work WORK --staged .suites --out OUT/suites.json SUITE...

Reads each suite's run_peers.py result (WORK/<suite>.json) and where it came from (.suites/<suite>/SOURCE),
writes one JSON document (per suite: tests, identical outcomes, each difference with both outcomes and its
reruns, gpuclean's findings with their processes, what gpuclean noted, wall time each way, versions) and
prints a table. Exit 1 if any suite's comparison failed (a reproduced difference, a finding, a leftover
process, a way that timed out: its table row says TIMED OUT, and only the tests both ways ended count) or has
no result.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import machine, table, write_json

COUNTS = ("passed", "failed", "error", "skipped")


def read_source(path: Path) -> dict[str, str]:
    """A staged suite's SOURCE file (key=value lines)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return {}
    return dict(line.split("=", 1) for line in lines if "=" in line)


def way_summary(res: dict[str, Any], base: dict[str, str] | None) -> dict[str, Any]:
    outcomes: dict[str, str] = res.get("outcomes", {})
    values = list(outcomes.values())
    summary: dict[str, Any] = {
        "tests": len(outcomes), **{k: values.count(k) for k in COUNTS},
        "wall_s": res.get("wall_s"), "exit": res.get("exit"), "hung": res.get("hung"),
        "timed_out": res.get("timed_out"),
        "leftovers": res.get("leftovers", []), "last_line": res.get("last_line")}
    if base is not None:
        summary["identical"] = sum(1 for k, v in outcomes.items() if base.get(k) == v)
        summary["differences"] = res.get("differences", [])
        summary["not_compared"] = res.get("not_compared", [])
        summary["not_reproduced"] = res.get("flaky", [])
        summary["findings"] = res.get("finding_records", [])
        summary["findings_text"] = res.get("findings", [])
        summary["checked"] = res.get("checked")
        summary["gpuclean_said"] = res.get("gpuclean_said")
        summary["report_notes"] = res.get("report_notes", {})
        summary["debris"] = res.get("debris", [])
    return summary


def suite_summary(name: str, work: Path, staged: Path) -> dict[str, Any]:
    source = read_source(staged / name / "SOURCE")
    path = work / f"{name}.json"
    if not path.exists():
        return {"suite": name, "source": source, "result": None,
                "failures": [f"no result: {path} missing (the run was cut short, or the suite not staged)"]}
    data = json.loads(path.read_text(encoding="utf-8"))
    results = data["results"]
    base = results.get("off", {}).get("outcomes", {})
    ways = {way: way_summary(res, None if way == "off" else base) for way, res in results.items()}
    return {"suite": name, "source": source, "installed": data.get("libs", {}), "targets": data["targets"],
            "env": data.get("env", []), "pytest_args": data.get("pytest_args", []), "cwd": data.get("cwd"),
            "ways": ways, "failures": data["failures"], "machine": data.get("machine")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suites", nargs="+")
    parser.add_argument("--work", required=True, help="run_suites.sh's work folder (WORK/<suite>.json)")
    parser.add_argument("--staged", default=".suites", help="the staged suites (their SOURCE files)")
    parser.add_argument("--out", required=True, help="the JSON document to write")
    args = parser.parse_args()
    suites = [suite_summary(name, Path(args.work), Path(args.staged)) for name in args.suites]
    rows = []
    totals = dict.fromkeys(("tests", "identical", "differences", "findings", "not_compared", "timed_out"), 0)
    for s in suites:
        ways = s.get("ways") or {}
        off, on = ways.get("off"), ways.get("all")
        version = s["source"].get("version", "?")
        installed = ", ".join(f"{k} {v}" for k, v in (s.get("installed") or {}).items() if k != "torch")
        ref = s["source"].get("tag") or s["source"].get("file", "")
        if not off or not on:
            rows.append([s["suite"], version, ref, "-", "-", "-", "-", "-", "-", "no result"])
            continue
        totals["tests"] += off["tests"]
        totals["identical"] += on["identical"]
        totals["differences"] += len(on["differences"])
        totals["findings"] += len(on["findings"])
        totals["not_compared"] += len(on["not_compared"])
        cut_short = [way for way, res in ways.items() if res.get("timed_out")]
        totals["timed_out"] += len(cut_short)
        verdict = (f"TIMED OUT ({', '.join(cut_short)})" if cut_short else "ok" if not s["failures"]
                   else "FAIL")
        rows.append([s["suite"], f"{version} ({installed})" if installed else version, ref, str(off["tests"]),
                     "/".join(str(off[k]) for k in COUNTS), str(on["identical"]),
                     str(len(on["differences"])), str(len(on["findings"])),
                     f"{off['wall_s']:.0f} / {on['wall_s']:.0f}", verdict])
    print(table(rows, ["suite", "version (installed)", "tag / sdist", "tests (off)",
                       "pass/fail/err/skip (off)", "identical", "differences", "findings", "wall s off / all",
                       "comparison"]))
    print(f"total: {totals['tests']} tests, {totals['identical']} identical outcomes, "
          f"{totals['differences']} differences, {totals['findings']} gpuclean findings"
          + (f", {totals['not_compared']} not compared ({totals['timed_out']} way(s) TIMED OUT)"
             if totals["timed_out"] else ""))
    for s in suites:
        for way, res in (s.get("ways") or {}).items():
            if res.get("timed_out"):
                print(f"{s['suite']}: {way} {res['timed_out']}")
        on = (s.get("ways") or {}).get("all")
        if on:
            for d in on["differences"]:
                print(f"{s['suite']}: differs: {d['test']}: off {d['off']}, all {d.get('all')}; alone: off "
                      f"{d.get('alone_off')}, all {d.get('alone_all')}; reproduced {d['reproduced']}")
            for text in on["findings_text"]:
                print(f"{s['suite']}: finding: {text}")
            if on.get("gpuclean_said"):
                print(f"{s['suite']}: gpuclean said: {on['gpuclean_said'][0]}")
            for note in on["report_notes"].get("notes", [])[:5]:
                print(f"{s['suite']}: gpuclean note: {note}")
        for failure in s["failures"]:
            print(f"{s['suite']}: FAIL {failure.splitlines()[0]}")
    write_json(args.out, {"machine": machine(), "totals": totals, "suites": suites})
    return 1 if any(s["failures"] for s in suites) else 0


if __name__ == "__main__":
    sys.exit(main())

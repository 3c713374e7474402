"""Fail if a gpuclean JSON report names a leaked process: ``python .ci/no_leftovers.py REPORT``."""

from __future__ import annotations

import json
import sys


def main(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        document = json.load(f)
    left = [f"{test['nodeid']}: pid {p['pid']} {p['cmdline'][:80]!r} ({p['ended_by'] or 'still running'})"
            for test in document["tests"] for p in test["leaked"]]
    # A fixture wider than a test that leaked is its own record, not the leak of the test it ended with.
    left += [f"fixture {fixture['name']} ({fixture['file']}:{fixture['line']}): pid {p['pid']} "
             f"{p['cmdline'][:80]!r} ({p['ended_by'] or 'still running'})"
             for fixture in document.get("fixtures", []) for p in fixture["leaked"]]
    left += [f"session end: pid {r['process']['pid']} {r['process']['cmdline'][:80]!r} ({r['ended_by']})"
             for r in document["session_reaped"]]
    for line in left:
        print(f"left behind by the tests: {line}", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""Counts passed/failed/skipped testcases over JUnit files (ctest, pytest).

usage: junit_summary.py FILE RC [FILE RC ...]  -> prints "passed failed skipped"

<failure>/<error> count as failed, <skipped> (or ctest's notrun/disabled) as
skipped, the rest as passed. A runner that exited non-zero without a failing
testcase (crash, build error, no tests collected) adds one failure.
"""

import sys
import xml.etree.ElementTree as ET

args = sys.argv[1:]
passed = failed = skipped = 0
for path, rc in zip(args[0::2], args[1::2]):
    f = 0
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        root = None
    for tc in root.iter("testcase") if root is not None else []:
        tags = {c.tag for c in tc}
        if tags & {"failure", "error"}:
            f += 1
        elif "skipped" in tags or tc.get("status") in ("notrun", "disabled"):
            skipped += 1
        else:
            passed += 1
    if int(rc) != 0 and f == 0:
        f = 1
    failed += f
print(passed, failed, skipped)

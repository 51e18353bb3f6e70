"""Write tests/durations.json from the output of ``pytest --durations=0`` runs, which
tests/conftest.py reads to hand the slowest tests out first.

Usage: python scripts/test_durations.py RUN.log [RUN.log ...]

A test's figure is its setup, call and teardown added up; a test that ran in several of the
runs (the suite on two broker releases) keeps the slowest of each phase.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"^\s*(?:> )?(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S.*?)\s*$")
OUT = Path(__file__).resolve().parent.parent / "tests" / "durations.json"


def main(logs: list[str]) -> None:
    phases: dict[tuple[str, str], float] = {}
    for log in logs:
        for line in Path(log).read_text(errors="replace").splitlines():
            match = LINE.match(line)
            if match:
                seconds, phase, nodeid = float(match[1]), match[2], match[3]
                phases[nodeid, phase] = max(seconds, phases.get((nodeid, phase), 0.0))
    total: dict[str, float] = {}
    for (nodeid, _phase), seconds in phases.items():
        total[nodeid] = round(total.get(nodeid, 0.0) + seconds, 2)
    if not total:
        sys.exit("no durations found: run pytest with --durations=0")
    ordered = dict(sorted(total.items(), key=lambda item: (-item[1], item[0])))
    OUT.write_text(json.dumps(ordered, indent=0) + "\n")
    print(f"{len(ordered)} tests, {sum(ordered.values()):.0f} s in all, written to {OUT}")


if __name__ == "__main__":
    main(sys.argv[1:])

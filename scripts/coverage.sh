#!/usr/bin/env bash
# Branch coverage of keyq's own code over the test suite, the processes the tests start
# (workers, janitors, CLI commands) included.
#
# Usage: scripts/coverage.sh [PYTEST ARGS...]     (make coverage)
#
# Every Python process of the venv starts coverage when COVERAGE_PROCESS_START names a
# configuration (coverage's own .pth file does it), so a worker a test starts is measured like
# the test itself; a process killed with -9 leaves no data, by design of the faults it plays.
# Writes build/coverage/: the combined data, coverage.json, and per-package.txt (statements,
# branches and the combined figure per component). The pytest exit status is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=${KEYQ_COVERAGE_DIR:-$PWD/build/coverage}
rm -rf "$OUT"
mkdir -p "$OUT"
RC="$OUT/coveragerc"
cat >"$RC" <<EOF
[run]
branch = True
parallel = True
source_pkgs = keyq
data_file = $OUT/data
sigterm = True
EOF

status=0
COVERAGE_PROCESS_START="$RC" "$BIN/python" -m pytest "$@" || status=$?
"$BIN/coverage" combine -q --rcfile "$RC"
"$BIN/coverage" json -q --rcfile "$RC" -o "$OUT/coverage.json"
"$BIN/python" - "$OUT/coverage.json" "$PWD" <<'EOF' | tee "$OUT/per-package.txt"
import json, sys
from pathlib import Path

report, root = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]).resolve()
packages = ("broker", "producer", "worker", "janitor", "src/keyq")
totals = {name: [0, 0, 0, 0] for name in (*packages, "all")}
for name, data in report["files"].items():
    path = Path(name).resolve()
    relative = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()
    package = next((p for p in packages if relative.startswith(p + "/")), None)
    summary = data["summary"]
    counts = (summary["num_statements"], summary["covered_lines"],
              summary["num_branches"], summary["covered_branches"])
    for key in filter(None, (package, "all")):
        totals[key] = [a + b for a, b in zip(totals[key], counts)]
print(f"{'package':10} {'statements':>12} {'branches':>12} {'combined':>9}")
for name, (stmts, covered, branches, taken) in totals.items():
    pct = lambda n, d: 100.0 * n / d if d else 100.0
    print(f"{name:10} {pct(covered, stmts):11.1f}% {pct(taken, branches):11.1f}% "
          f"{pct(covered + taken, stmts + branches):8.1f}%")
EOF
exit "$status"

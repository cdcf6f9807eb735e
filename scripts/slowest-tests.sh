#!/usr/bin/env bash
# The slowest tests of the last CTest run in a build folder, with their seconds, slowest first.
#   scripts/slowest-tests.sh BUILD_DIR [N]   (default N = 10)
set -euo pipefail
log=${1:?build folder}/Testing/Temporary/LastTest.log
[ -f "$log" ] || { echo "slowest-tests.sh: no $log (run ctest first)" >&2; exit 1; }
echo "slowest tests ($1):"
# LastTest.log names each test ("3/219 Test: NAME") before its time ("Test time =   1.23 sec").
# awk, not head, keeps the first N: head exits early, and sort writing to the closed pipe dies of
# SIGPIPE, which pipefail turned into CI's exit 141 once the list outgrew one write.
awk '/^[0-9]+\/[0-9]+ Test: / { name = $3 } /^Test time = / { printf "%9.2f s  %s\n", $4, name }' "$log" |
    sort -rn | awk -v n="${2:-10}" 'NR <= n'

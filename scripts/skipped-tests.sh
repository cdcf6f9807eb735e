#!/usr/bin/env bash
# The tests the last CTest run in a build folder skipped, and why (each skip's own message): on a
# machine without a GPU, the GPU tests (LOOM_GPU_TEST, `ctest -L gpu`: scripts/gpu-suite.sh runs
# them on the GPU machine), which CTest also lists as "(Skipped)" when every test of a process
# skipped.
#   scripts/skipped-tests.sh BUILD_DIR
set -euo pipefail
log=${1:?build folder}/Testing/Temporary/LastTest.log
[ -f "$log" ] || { echo "skipped-tests.sh: no $log (run ctest first)" >&2; exit 1; }
# GoogleTest prints "FILE:LINE: Skipped", the skip's message on the next line, then
# "[  SKIPPED ] Suite.Test (N ms)".
awk 'after_skip { why = $0; after_skip = 0 }
     / Skipped$/ { after_skip = 1 }
     /^\[  SKIPPED \] [^ ]+ \([0-9]+ ms\)$/ { skipped[++n] = $4 "  (" why ")"; why = "" }
     END {
       if (n == 0) { print "skipped tests: none"; exit }
       print "skipped tests: " n
       for (i = 1; i <= n; ++i) print "  " skipped[i]
     }' "$log"

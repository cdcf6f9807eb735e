#!/usr/bin/env bash
# On the GPU machine: builds loom (scripts/gpu-build.sh) and runs the whole suite under the image's
# CUDA LibTorch, what CI (Debian's CPU LibTorch 1.13) cannot: the CUDA kernels, NCCL on one GPU,
# LibTorch 2.x. Then prints a pass/fail table, failing suites and their failed tests first. Left to
# CI: the JS tokenizer parity (node and every family), the per-family damage fuzz, chat templates
# (every family), the TensorBoard reader and the page in Chromium (Python and browser packages
# the image lacks); the carried families' data comes from .debs/test-data.tar.xz.
#   scripts/gpu-suite.sh [BUILD_DIR]      (run it in every session that changes runtime code)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
LOOM_GPU_SKIP_TESTS=1 scripts/gpu-build.sh "$build" || { echo "gpu-suite: the build failed" >&2; exit 1; }
export LOOM_TEST_DATA_PARTIAL=1
log="$build/suite.log"
ctest --test-dir "$build" -j "${LOOM_SUITE_JOBS:-8}" -E "tokenizer_parity|EveryFamily|chat_template_references|tensorboard_events_reader|run_page_in_chromium" --output-on-failure --timeout 600 >"$log" 2>&1
status=$?
python3 - "$log" <<'PY'
import re, sys
rows, failed_tests = [], []
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"\s*\d+/\d+ Test\s+#\d+: (\S+) \.*\s*(\*{0,3})(Passed|Failed|Timeout|Not Run|Exception|Skipped)?.*?([\d.]+) sec", line)
    if m:
        rows.append((m.group(1), m.group(3) or "Failed", float(m.group(4))))
    m = re.match(r"\[  FAILED  \] (\S+) \(", line)
    if m:
        failed_tests.append(m.group(1))
bad = [r for r in rows if r[1] != "Passed"]
print(f"{'suite':70} {'result':>8} {'seconds':>8}")
for name, result, seconds in bad + [r for r in rows if r[1] == "Passed"]:
    print(f"{name:70} {result:>8} {seconds:8.1f}")
print(f"\n{len(rows) - len(bad)} of {len(rows)} suites passed")
for t in sorted(set(failed_tests)):
    print(f"failed: {t}")
PY
exit $status

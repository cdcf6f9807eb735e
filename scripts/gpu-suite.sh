#!/usr/bin/env bash
# On the GPU machine: builds loom (scripts/gpu-build.sh) and runs the whole suite under the image's
# CUDA LibTorch, what CI (Debian's CPU LibTorch 1.13) cannot: the CUDA kernels, NCCL on one GPU,
# LibTorch 2.x. Then prints a pass/fail table, failing suites and their failed tests first. Left to
# CI: the JS tokenizer parity (node and every family), the per-family damage fuzz, chat templates
# (every family), the TensorBoard reader and the page in Chromium (Python and browser packages
# the image lacks), the ABI check (abigail-tools); the carried families' data comes from
# .debs/test-data.tar.xz.
# MODE 7.5 or 7.0 runs the suite as a T4 or V100 would: the kernels built as compute_75 (or 70) PTX
# only, which the driver JIT-compiles for this GPU, and LOOM_DEVICE_CAPABILITY set so that loom
# chooses kernels and dtypes as on that device (the device code is then exactly the 7.x code).
# nvcc 13 builds no compute_70, so 7.0 mode runs the 7.5 code chosen as on a 7.0 device; loom's
# kernels have no code of their own for 7.0 (docs/gpus.md).
#   scripts/gpu-suite.sh [BUILD_DIR] [MODE]   (MODE: normal (default), 7.5, 7.0; run it in every
#                                              session that changes runtime code)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
mode=${2:-normal}
case "$mode" in
  normal) unset LOOM_CUDA_ARCHITECTURES LOOM_DEVICE_CAPABILITY LOOM_EXPECT_KERNEL_CAPABILITY ;;
  7.5 | 7.0)
    arch=${mode/./}
    nvcc_path=$(python3 -c 'import torch.utils.cpp_extension as c; print(c.CUDA_HOME or "")' 2>/dev/null)/bin/nvcc
    command -v nvcc >/dev/null && nvcc_path=$(command -v nvcc)
    "$nvcc_path" --list-gpu-arch 2>/dev/null | grep -qx "compute_$arch" || arch=75
    export LOOM_CUDA_ARCHITECTURES="$arch-virtual" LOOM_DEVICE_CAPABILITY=$mode LOOM_EXPECT_KERNEL_CAPABILITY=$mode
    echo "gpu-suite: mode $mode: kernels as compute_$arch PTX, chosen as on compute capability $mode" ;;
  *) echo "gpu-suite: mode '$mode': use normal, 7.5 or 7.0" >&2; exit 2 ;;
esac
LOOM_GPU_SKIP_TESTS=1 scripts/gpu-build.sh "$build" || { echo "gpu-suite: the build failed" >&2; exit 1; }
export LOOM_TEST_DATA_PARTIAL=1
log="$build/suite-$mode.log"
ctest --test-dir "$build" -j "${LOOM_SUITE_JOBS:-8}" -E "tokenizer_parity|EveryFamily|chat_template_references|tensorboard_events_reader|run_page_in_chromium|abi_check" --output-on-failure --timeout 600 >"$log" 2>&1
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
bad = [r for r in rows if r[1] not in ("Passed", "Skipped")]
skipped = [r for r in rows if r[1] == "Skipped"]
print(f"{'suite':70} {'result':>8} {'seconds':>8}")
for name, result, seconds in bad + skipped + [r for r in rows if r[1] == "Passed"]:
    print(f"{name:70} {result:>8} {seconds:8.1f}")
print(f"\n{len(rows) - len(bad) - len(skipped)} of {len(rows)} suites passed, {len(skipped)} skipped (every test of theirs skipped: reasons below)")
for t in sorted(set(failed_tests)):
    print(f"failed: {t}")
PY
scripts/skipped-tests.sh "$build"
exit $status

#!/usr/bin/env bash
# Sets up (Debian packages), builds loom with its tests, and runs them all; then builds it again
# with clang under AddressSanitizer and UndefinedBehaviorSanitizer, runs the unit tests there, and
# gives every fuzz target a short run over its seed corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-debian.sh --tests
scripts/build.sh -DLOOM_BUILD_TESTS=ON
ctest --test-dir build --output-on-failure -j 2
scripts/build-sanitized.sh
# LibTorch keeps process-lifetime allocations, so leak checking is off; every other finding fails.
# (The tokenizer parity and out-of-tree plugin tests run the same code as above.)
ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 ctest --test-dir build-fuzz --output-on-failure -j 2 -E "tokenizer_parity|external_plugin"
scripts/fuzz.sh --runs 2000

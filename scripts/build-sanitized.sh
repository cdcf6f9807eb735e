#!/usr/bin/env bash
# Configures and builds loom with clang, AddressSanitizer and UndefinedBehaviorSanitizer into
# ./build-fuzz, with the tests and the libFuzzer targets (fuzz/). Extra arguments go to cmake.
# -O1 with line tables: reports name file and line, at a fraction of full debug information's
# compile time.
set -euo pipefail
cd "$(dirname "$0")/.."
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/loom-ccache}
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -gline-tables-only -DNDEBUG" -DLOOM_BUILD_TESTS=ON -DLOOM_BUILD_FUZZERS=ON "$@" >/dev/null
cmake --build build-fuzz -j "${LOOM_BUILD_JOBS:-2}"

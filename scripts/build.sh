#!/usr/bin/env bash
# Configures and builds loom into ./build (2 parallel jobs: a LibTorch translation unit wants
# several GiB and most machines here have 2 cores). Extra arguments go to cmake's configure step.
# A Release build (-O2, no debug information: half the compile time); LOOM_BUILD_TYPE=RelWithDebInfo
# for one to debug.
set -euo pipefail
cd "$(dirname "$0")/.."
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/loom-ccache}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="${LOOM_BUILD_TYPE:-Release}" "$@" >/dev/null
cmake --build build -j "${LOOM_BUILD_JOBS:-2}"

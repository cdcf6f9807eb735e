#!/usr/bin/env bash
# Configures and builds loom into ./build (2 parallel jobs: a LibTorch translation unit wants
# several GiB and most machines here have 2 cores). Extra arguments go to cmake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/loom-ccache}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake --build build -j "${LOOM_BUILD_JOBS:-2}"

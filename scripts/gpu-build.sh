#!/usr/bin/env bash
# On the GPU machine: builds loom against the image's CUDA LibTorch (python3's torch) with the
# missing dependencies unpacked from .debs/ into a private prefix (never into /), then runs the
# tests. Usage: scripts/gpu-build.sh [BUILD_DIR]   (default build-gpu)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
prefix=${LOOM_DEPS_PREFIX:-/tmp/loom-deps}
mkdir -p "$prefix"
for deb in .debs/*.deb; do dpkg -x "$deb" "$prefix"; done
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOOM_BUILD_TESTS=ON \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix/usr"
cmake --build "$build" -j "$(nproc)"
ctest --test-dir "$build" --output-on-failure -j 8

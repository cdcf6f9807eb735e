#!/usr/bin/env bash
# On the GPU machine: builds loom against the image's CUDA LibTorch (python3's torch) with the
# missing dependencies unpacked from .debs/ into a private prefix (never into /), then runs the
# tests. Usage: scripts/gpu-build.sh [BUILD_DIR]   (default build-gpu; LOOM_GPU_SKIP_TESTS=1: build only)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
prefix=${LOOM_DEPS_PREFIX:-/tmp/loom-deps}
mkdir -p "$prefix"
for deb in .debs/*.deb; do dpkg -x "$deb" "$prefix"; done
# The tokenizer families that travel (fetch-gpu-debs.sh): the suite's, and the parity check's when carried.
for data in .debs/test-data.tar.xz .bench-data/tokenizer-families.tar.xz; do
  [ -f "$data" ] || continue
  marker=.test-data/.unpacked-$(basename "$data")
  sum=$(cksum <"$data")
  [ "$(cat "$marker" 2>/dev/null)" != "$sum" ] || continue  # this archive, unpacked already (a warm machine)
  mkdir -p .test-data && tar xJf "$data" -C .test-data && echo "$sum" >"$marker"
done
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
# nccl.h and libnccl come with the nvidia-nccl wheel beside torch.
nccl_root=$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])')
# DT_RPATH, not RUNPATH: the private prefix must also serve the libraries' own dependencies
# (libicuuc needs libicudata), which RUNPATH would leave to the system's search path.
rpath_flags="-Wl,--disable-new-dtags"
# LOOM_CUDA_ARCHITECTURES (e.g. 75-virtual: compute_75 PTX only) replaces the default list; unset, the
# default is chosen again (a build folder keeps what it was last given otherwise).
archs=${LOOM_CUDA_ARCHITECTURES:+-DLOOM_CUDA_ARCHITECTURES=$LOOM_CUDA_ARCHITECTURES}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${LOOM_BUILD_TYPE:-Release}" -DLOOM_BUILD_TESTS=ON ${archs:--ULOOM_CUDA_ARCHITECTURES} \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix/usr" -DLOOM_NCCL_ROOT="$nccl_root" -DLOOM_USE_GLOO="${LOOM_USE_GLOO:-ON}" \
  -DCMAKE_EXE_LINKER_FLAGS="$rpath_flags" -DCMAKE_SHARED_LINKER_FLAGS="$rpath_flags" -DCMAKE_MODULE_LINKER_FLAGS="$rpath_flags"
cmake --build "$build" -j "$(nproc)"
# Only some tokenizer families travel (fetch-gpu-debs.sh): the fetch fixture keeps to those, and the
# per-family tests (the JS parity, which also needs node, and the damage fuzz) run in CI instead.
# bench/run_tokenizer.sh checks the carried families against python's `tokenizers` here.
export LOOM_TEST_DATA_PARTIAL=1
[ "${LOOM_GPU_SKIP_TESTS:-0}" = 1 ] && exit 0
ctest --test-dir "$build" --output-on-failure -j 8 -E "tokenizer_parity|EveryFamily" ${LOOM_GPU_TESTS:+-R "$LOOM_GPU_TESTS"}

#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-build.sh: one MoE layer's experts forward and backward, loom's
# kit against transformers' grouped_mm and eager experts, in one call. Shapes: Qwen3-30B-A3B's layer
# (hidden 2048, 128 experts of width 768, top-8) at 4 x 1024 tokens, and Mixtral-8x7B's (4096, 8 of
# 14336, top-2) at 2 x 1024.
#   bench/run_moe_block.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
nvidia-smi --query-gpu=name --format=csv,noheader
for shape in "4096 2048 768 128 8" "2048 4096 14336 8 2"; do
  "$build"/bin/loom_moe_block_bench $shape
  python3 bench/hf_moe_block.py $shape
done

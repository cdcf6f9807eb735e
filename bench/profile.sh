#!/usr/bin/env bash
# On nvidia-h200, after scripts/gpu-build.sh: where one training step's GPU time goes (#28), loom
# beside HF transformers + PEFT (bf16 adapters) on the same shape in one call. Both processes run
# under bench/kernel_trace.c (a CUPTI injection library: every kernel, copy and memset with its
# start and end on the GPU's clock; the machine has no Nsight Systems), and bench/trace_table.py
# splits a step into the big matmuls, LoRA's small ones, attention, norms, rotary, activation, the
# loss, the optimizer, copies, the rest, and the time no kernel ran.
#   bench/profile.sh [BUILD_DIR] [SHAPE] [SETTINGS...]   (SHAPE: 8b (4 x 1024) or 1b (8 x 1024))
# Writes bench/out-profile/: trace-{loom,hf}-SHAPE.tsv (the records), profile-{loom,hf}-SHAPE.json,
# and prints both tables for bench/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
shape=${2:-8b}
shift 2 2>/dev/null || shift $#
out=bench/out-profile
mkdir -p "$out"
case $shape in
  # Base products of the 8B at 4 x 1024 take 50 us and more, LoRA's 30 us and less; the 1B's
  # smallest base products (k and v, 8 x 1024) take about 25 us, LoRA's widest (up's B) about as long.
  8b) sets=(--set train.batch_size=4); hf=(--batch 4 --seq 1024); small_us=40 ;;
  1b) sets=(--set model.hidden_size=2048 --set model.intermediate_size=8192 --set model.num_hidden_layers=16 --set model.tie_word_embeddings=true
            --set train.batch_size=8)
      hf=(--shape 1b --batch 8 --seq 1024); small_us=20 ;;
  *) echo "profile: SHAPE is 8b or 1b" >&2; exit 2 ;;
esac
cupti_h=$(find /usr/local/cuda/ -name cupti.h 2>/dev/null | head -1)
cupti_so=$(find /usr/local/cuda/ -name 'libcupti.so' 2>/dev/null | head -1)
[ -n "$cupti_h" ] && [ -n "$cupti_so" ] || { echo "profile: CUPTI's header or library is not under /usr/local/cuda" >&2; exit 1; }
gcc -O2 -shared -fPIC -I"$(dirname "$cupti_h")" bench/kernel_trace.c -L"$(dirname "$cupti_so")" -Wl,-rpath,"$(dirname "$cupti_so")" -lcupti \
  -o "$out/libkernel_trace.so" || exit 1
trace() {  # NAME COMMAND...: the command under the tracer
  local name=$1
  shift
  CUDA_INJECTION64_PATH="$PWD/$out/libkernel_trace.so" LOOM_KERNEL_TRACE="$out/trace-$name-$shape.tsv" timeout "${LOOM_PROFILE_TIMEOUT:-300}" "$@" \
    > "$out/$name-$shape.log" 2>&1 || { echo "profile: $name failed or ran out of time: $out/$name-$shape.log"; return 1; }
}
python3 bench/make_bench_data.py 200 1100
rm -rf "$out/loom-$shape"
trace loom "$build/bin/loom" run bench/llama8b_lora.toml --log-level warn --output "$out/loom-$shape" --set train.max_steps=20 "${sets[@]}" "$@"
trace hf python3 bench/hf_peft_lora.py --steps 10 --warmup 5 --lora-dtype bf16 "${hf[@]}"
for name in loom hf; do
  [ -s "$out/trace-$name-$shape.tsv" ] || continue
  python3 bench/trace_table.py "$out/trace-$name-$shape.tsv" --label "$name $shape" --skip 5 --steps 10 --small-us "$small_us" \
    --json "$out/profile-$name-$shape.json"
  echo
done

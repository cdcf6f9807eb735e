#!/usr/bin/env bash
# On the GPU machine, after a change that should not move speed: the GPU tests of the CUDA paths,
# then loom's 8B LoRA and QLoRA runs and the quickstart's tiny model, each a tokens/s figure to set
# beside bench/RESULTS.md's last ones. Writes bench/out-regression/summary.txt.
#   LOOM_GPU_SKIP_TESTS=1 scripts/gpu-build.sh && bench/run_regression.sh [BUILD_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out=bench/out-regression
rm -rf "$out" && mkdir -p "$out"
summary="$out/summary.txt"
"$build/bin/loom_tests" --gtest_filter='Quantize.*:QLora.*:Generation.*:Models/Parity*:TensorParallel.*' >"$out/tests.log" 2>&1
echo "GPU tests: $(tail -n 3 "$out/tests.log" | grep -E 'PASSED|FAILED' | tr '\n' ' ')" | tee -a "$summary"

# Mean tokens/s of the steps after `skip`, and the peak memory, of a run's metrics.jsonl.
speed() {
  python3 - "$1" "$2" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
train = [r for r in rows if not r.get("eval")]
timed = [r for r in train if r["step"] > int(sys.argv[2])]
peak = max((max(r.get("peak_memory_bytes", {"-": 0}).values()) for r in train), default=0) / 2**30
print(f"{sum(r['tokens_per_s'] for r in timed) / len(timed):,.0f} tokens/s (steps {sys.argv[2]}+1..{train[-1]['step']}), peak {peak:.2f} GiB")
PY
}
python3 bench/make_bench_data.py
for adapter in lora qlora; do
  if "$build/bin/loom" run bench/llama8b_lora.toml --set adapter.plugin=$adapter --output "$out/8b-$adapter" --log-level warn >"$out/8b-$adapter.log" 2>&1; then
    echo "8B $adapter: $(speed "$out/8b-$adapter/metrics.jsonl" 10)" | tee -a "$summary"
  else
    echo "8B $adapter: failed ($(tail -n 1 "$out/8b-$adapter.log"))" | tee -a "$summary"
  fi
done
for round in 1 2; do
  "$build/bin/loom" run configs/quickstart.toml --set train.max_steps=400 --output "$out/quickstart-$round" --log-level warn >"$out/quickstart-$round.log" 2>&1 &&
    echo "quickstart round $round: $(speed "$out/quickstart-$round/metrics.jsonl" 50)" | tee -a "$summary"
done

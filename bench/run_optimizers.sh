#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-build.sh: each [train] optimizer (#55) on a full fine-tune
# of a 1B Llama shape (bench/llama1b_full.toml: bf16, float32 masters, 4 x 1024): tokens/s over
# steps 11-30, the measured peak memory against loom's plan (which counts each optimizer's state),
# and the loss after 30 steps. Writes bench/out-optimizers/.
#   bench/run_optimizers.sh [BUILD_DIR] [OPTIMIZERS]   (default: adamw adamw_8bit lion adafactor sgd)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
optimizers=${2:-adamw adamw_8bit lion adafactor sgd}
out=bench/out-optimizers
mkdir -p "$out"
python3 bench/make_bench_data.py 200 1100 > /dev/null
for o in $optimizers; do
  rm -rf "$out/loom-$o"
  "$build/bin/loom" plan bench/llama1b_full.toml --json --set "train.optimizer=\"$o\"" > "$out/plan-$o.json" 2> "$out/plan-$o.log" ||
    echo "plan $o failed: see $out/plan-$o.log"
  timeout "${LOOM_RUN_TIMEOUT:-300}" "$build/bin/loom" run bench/llama1b_full.toml --output "$out/loom-$o" --log-level warn \
    --set "train.optimizer=\"$o\"" > "$out/loom-$o.log" 2>&1 || echo "loom $o failed (exit $?): see $out/loom-$o.log"
done
python3 - "$out" $optimizers <<'PY'
import json, os, sys
out, names = sys.argv[1], sys.argv[2:]
print("| optimizer | tokens/s | peak GiB | plan GiB | plan - peak | trainable state GiB (plan) | loss at step 30 |")
print("|---|---|---|---|---|---|---|")
for name in names:
    path = f"{out}/loom-{name}/metrics.jsonl"
    if not os.path.exists(path):
        print(f"| {name} | failed | | | | | |")
        continue
    rows = [json.loads(l) for l in open(path) if l.strip()]
    train = [r for r in rows if not r.get("eval")]
    timed = [r for r in train if r["step"] > 10]
    rate = sum(r["tokens_per_s"] for r in timed) / max(len(timed), 1)
    peak = max(max(r.get("peak_memory_bytes", {"-": 0}).values()) for r in train) / 2**30
    try:
        device = json.load(open(f"{out}/plan-{name}.json"))["devices"][0]
        plan, state = device["total_bytes"] / 2**30, device["trainable_state_bytes"] / 2**30
    except (OSError, ValueError, KeyError, IndexError):
        plan = state = float("nan")
    print(f"| {name} | {rate:,.0f} | {peak:.1f} | {plan:.1f} | {plan - peak:+.1f} | {state:.1f} | {train[-1]['loss']:.4f} |")
PY

#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-build.sh: a mixture of experts' LoRA training speed, loom beside
# transformers 5 + PEFT in one call (issue 53). Qwen3-30B-A3B's shape with 12 layers
# (bench/qwen3_30b_a3b/config.json), random init, bf16, LoRA r16, 4 x 1024 tokens, one GPU:
#   loom (bench/qwen3_moe_lora.toml), LoRA on attention, and on attention and every expert: 30 steps each,
#   the log's tokens/s of steps 11-30
#   transformers grouped_mm experts + PEFT on attention, and on attention and every expert (its eager
#   experts are 13x slower: bench/RESULTS.md, one MoE layer's experts)
# Writes bench/out-moe/.
#   bench/run_moe.sh [BUILD_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out=bench/out-moe
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 bench/make_bench_data.py 200 1100 > /dev/null
"$build"/bin/loom plan bench/qwen3_moe_lora.toml > "$out/plan.txt" 2>&1 || echo "plan failed: see $out/plan.txt"
loom_run() {  # NAME SETTINGS...: 30 steps of bench/qwen3_moe_lora.toml
  local name=$1
  shift
  rm -rf "$out/loom-$name"
  timeout 900 "$build"/bin/loom run bench/qwen3_moe_lora.toml --output "$out/loom-$name" --log-level warn "$@" > "$out/loom-$name.log" 2>&1 ||
    echo "loom $name failed: see $out/loom-$name.log"
  rm -rf "$out/loom-$name/checkpoints" "$out/loom-$name/adapter"
}
loom_run attention
loom_run experts --set 'adapter.target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]'
for run in "grouped_mm" "grouped_mm --expert-lora"; do
  name=$(echo "$run" | tr ' ' '_' | tr -d '-')
  timeout 900 python3 bench/hf_moe_lora.py --experts-impl $run --json "$out/hf-$name.json" > "$out/hf-$name.log" 2>&1 || echo "hf $run failed: see $out/hf-$name.log"
done
python3 - "$out" <<'PY'
import json, sys, os
out = sys.argv[1]
def loom(name):
    path = os.path.join(out, f"loom-{name}", "metrics.jsonl")
    if not os.path.exists(path):
        return 0, 0
    rows = [json.loads(l) for l in open(path) if l.strip()]
    train = [r for r in rows if "tokens_per_s" in r and r["step"] > 10]
    peak = max((max(r.get("peak_memory_bytes", {"": 0}).values()) for r in rows if "loss" in r), default=0) / 2**30
    return (sum(r["tokens_per_s"] for r in train) / len(train) if train else 0), peak
mine = {}
for name in ("attention", "experts"):
    mine[name] = loom(name)
    print(f"loom, LoRA on {name}: {mine[name][0]:,.0f} tokens/s, peak {mine[name][1]:.1f} GiB")
for name in ("grouped_mm", "grouped_mm_expertlora"):
    p = os.path.join(out, f"hf-{name}.json")
    if os.path.exists(p):
        h = json.load(open(p))
        same = mine["experts" if "expertlora" in name else "attention"]
        print(f"transformers {name}: {h['tokens_per_s']:,.0f} tokens/s, peak {h['peak_gib']:.1f} GiB, {h['trainable']:,} trainable; "
              f"loom / it {same[0] / h['tokens_per_s']:.2f}x tokens/s, {same[1] / h['peak_gib']:.2f}x peak")
PY

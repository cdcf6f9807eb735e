#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-build.sh: a mixture of experts' LoRA training speed, loom beside
# transformers 5 + PEFT in one call (issue 53). Qwen3-30B-A3B's shape with 12 layers
# (bench/qwen3_30b_a3b/config.json), random init, bf16, LoRA r16, 4 x 1024 tokens, one GPU:
#   loom, LoRA on attention (bench/qwen3_moe_lora.toml): 30 steps, the log's tokens/s of steps 11-30
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
rm -rf "$out/loom"
timeout 900 "$build"/bin/loom run bench/qwen3_moe_lora.toml --output "$out/loom" --log-level warn > "$out/loom.log" 2>&1 || echo "loom failed: see $out/loom.log"
for run in "grouped_mm" "grouped_mm --expert-lora"; do
  name=$(echo "$run" | tr ' ' '_' | tr -d '-')
  timeout 900 python3 bench/hf_moe_lora.py --experts-impl $run --json "$out/hf-$name.json" > "$out/hf-$name.log" 2>&1 || echo "hf $run failed: see $out/hf-$name.log"
done
python3 - "$out" <<'PY'
import json, sys, os
out = sys.argv[1]
rows = [json.loads(l) for l in open(os.path.join(out, "loom", "metrics.jsonl")) if l.strip()]
train = [r for r in rows if "tokens_per_s" in r and r["step"] > 10]
peak = max((max(r.get("peak_memory_bytes", {"": 0}).values()) for r in rows if "loss" in r), default=0) / 2**30
loom = sum(r["tokens_per_s"] for r in train) / len(train) if train else 0
print(f"loom (attention LoRA): {loom:,.0f} tokens/s, peak {peak:.1f} GiB")
for name in ("grouped_mm", "grouped_mm_expertlora"):
    p = os.path.join(out, f"hf-{name}.json")
    if os.path.exists(p):
        h = json.load(open(p))
        print(f"transformers {name}: {h['tokens_per_s']:,.0f} tokens/s, peak {h['peak_gib']:.1f} GiB, {h['trainable']:,} trainable; loom / it {loom / h['tokens_per_s']:.2f}x")
PY

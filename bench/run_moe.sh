#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-build.sh: a mixture of experts' LoRA training speed, loom beside
# transformers 5 + PEFT in one call (issue 53). Qwen3-30B-A3B's shape with 12 layers
# (bench/qwen3_30b_a3b/config.json), random init, bf16, LoRA r16, 4 x 1024 tokens, one GPU:
#   loom (bench/qwen3_moe_lora.toml), LoRA on attention, and on attention and every expert: 30 steps each,
#   the log's tokens/s of steps 11-30
#   transformers grouped_mm experts + PEFT on attention, and on attention and every expert (its eager
#   experts are 13x slower: bench/RESULTS.md, one MoE layer's experts)
# PARTS (default "speed"; any of speed, qlora48, generate):
#   qlora48: all 48 layers with the experts 4-bit (qlora, NF4, double quantization; bench/qwen3_30b_a3b_48),
#     LoRA on attention, 1 x 1024 tokens, every layer recomputed: 10 steps, its peak beside the plan's
#   generate: all 48 layers in bf16, greedy, 1 prompt of 50 tokens: loom generate's ms a step, and
#     transformers 5 (grouped_mm experts; dynamic and static cache) by bench/hf_generate.py
# LOOM_MOE_SHAPE=deepseek_v2_lite runs the speed part on DeepSeek-V2-Lite's shape in DeepSeek-V3's
# architecture instead (bench/deepseek_v2_lite_lora.toml: multi-head latent attention, 64 experts of
# 1408 units, top-6, 2 shared, 12 layers), into bench/out-moe-deepseek_v2_lite/.
# Writes bench/out-moe/.
#   bench/run_moe.sh [BUILD_DIR] [PARTS]
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
parts=${2-speed}
out=bench/out-moe
shape=${LOOM_MOE_SHAPE:-qwen3_30b_a3b}
case $shape in
  qwen3_30b_a3b) toml=bench/qwen3_moe_lora.toml targets=q_proj,k_proj,v_proj,o_proj ;;
  deepseek_v2_lite) toml=bench/deepseek_v2_lite_lora.toml targets=q_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj out=bench/out-moe-$shape ;;
  *) echo "run_moe.sh: LOOM_MOE_SHAPE=$shape is not a shape it runs (qwen3_30b_a3b, deepseek_v2_lite)" >&2; exit 2 ;;
esac
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 bench/make_bench_data.py 200 1100 > /dev/null
experts_lora='adapter.target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]'
qlora48=(--set model.path=\"bench/qwen3_30b_a3b_48\" --set 'adapter.plugin="qlora"' --set train.batch_size=1
         --set 'train.activation_checkpointing="every-layer"' --set train.max_steps=10 --set train.log_every=1)
case " $parts " in *" qlora48 "*)
  "$build"/bin/loom plan bench/qwen3_moe_lora.toml "${qlora48[@]}" > "$out/plan-qlora48.txt" 2>&1 || echo "plan failed: see $out/plan-qlora48.txt"
  rm -rf "$out/loom-qlora48"
  timeout 900 "$build"/bin/loom run bench/qwen3_moe_lora.toml --output "$out/loom-qlora48" --log-level warn "${qlora48[@]}" > "$out/loom-qlora48.log" 2>&1 ||
    echo "loom qlora48 failed: see $out/loom-qlora48.log"
  python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/loom-qlora48/metrics.jsonl") if l.strip()]
train = [r for r in rows if "loss" in r]
peak = max(max(r.get("peak_memory_bytes", {"": 0}).values()) for r in train) / 2**30
rate = [r["tokens_per_s"] for r in train if "tokens_per_s" in r and r["step"] > 3]
print(f"loom 48 layers, 4-bit experts, 1 x 1024, recomputed: peak {peak:.2f} GiB, {sum(rate) / max(len(rate), 1):,.0f} tokens/s, loss {train[0]['loss']:.3f} -> {train[-1]['loss']:.3f}")
PY
  grep -iE "cuda:0|peak|total|weights" "$out/plan-qlora48.txt" | head -12 ;;
esac
case " $parts " in *" generate "*)
  prompt50="the prompt of this benchmark, fifty bytes long ."
  timeout 600 "$build"/bin/loom generate bench/qwen3_moe_lora.toml --set model.path=\"bench/qwen3_30b_a3b_48\" --set train.batch_size=1 --prompt "$prompt50" --max-new-tokens 160 \
    --rows 1 --ignore-eos --log-level info > "$out/gen-48.log" 2>&1 || echo "loom generate failed: see $out/gen-48.log"
  grep -E "step\(s\) at|peak" "$out/gen-48.log" | tail -2
  [ -n "${LOOM_MOE_SKIP_HF:-}" ] || timeout 900 python3 bench/hf_generate.py --shape qwen3_30b_a3b --prompts 1 --prefill --out "$out/hf-gen-48.json" \
    > "$out/hf-gen-48.log" 2>&1 || echo "hf_generate failed: see $out/hf-gen-48.log"
  cat "$out/hf-gen-48.json" 2>/dev/null | head -30 ;;
esac
case " $parts " in *" speed "*) ;; *) exit 0 ;; esac
"$build"/bin/loom plan "$toml" > "$out/plan.txt" 2>&1 || echo "plan failed: see $out/plan.txt"
loom_run() {  # NAME SETTINGS...: 30 steps of $toml
  local name=$1
  shift
  rm -rf "$out/loom-$name"
  timeout 900 "$build"/bin/loom run "$toml" --output "$out/loom-$name" --log-level warn "$@" > "$out/loom-$name.log" 2>&1 ||
    echo "loom $name failed: see $out/loom-$name.log"
  rm -rf "$out/loom-$name/checkpoints" "$out/loom-$name/adapter"
}
loom_run attention
loom_run experts --set "$experts_lora"
for run in "grouped_mm" "grouped_mm --expert-lora"; do
  name=$(echo "$run" | tr ' ' '_' | tr -d '-')
  timeout 900 python3 bench/hf_moe_lora.py --shape "$shape" --targets "$targets" --experts-impl $run --json "$out/hf-$name.json" > "$out/hf-$name.log" 2>&1 ||
    echo "hf $run failed: see $out/hf-$name.log"
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

#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-build.sh: activation checkpointing on the 8B LoRA shape
# (bench/llama8b_lora.toml: bf16, r 16 on every projection, batch 4 x 1024, one GPU). loom without
# and with [train] activation_checkpointing = "every-layer" (tokens/s, peak, the plan's prediction,
# and how far the losses of the two runs differ), then HF transformers + PEFT (bf16 adapters)
# without and with gradient checkpointing, all in this one call. Writes bench/out-ckpt/.
#   bench/run_checkpointing.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out=bench/out-ckpt
rm -rf "$out" && mkdir -p "$out"
python3 bench/make_bench_data.py
for mode in none every-layer; do
  set_mode=(--set "train.activation_checkpointing=\"$mode\"")
  "$build/bin/loom" plan bench/llama8b_lora.toml --json "${set_mode[@]}" > "$out/plan-$mode.json"
  "$build/bin/loom" run bench/llama8b_lora.toml --output "$out/loom-$mode" --log-level warn "${set_mode[@]}" > "$out/loom-$mode.log"
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
losses = {}
for mode in ("none", "every-layer"):
    rows = [json.loads(l) for l in open(f"{out}/loom-{mode}/metrics.jsonl") if l.strip()]
    train = [r for r in rows if not r.get("eval")]
    timed = [r for r in train if r["step"] > 10]  # the first steps warm up kernels and the allocator
    tps = sum(r["tokens_per_s"] for r in timed) / len(timed)
    peak = max(max(r.get("peak_memory_bytes", {"-": 0}).values()) for r in train) / 2**30
    plan = json.load(open(f"{out}/plan-{mode}.json"))
    predicted = plan["devices"][0]["total_bytes"] / 2**30
    losses[mode] = [r["loss"] for r in train]
    print(f"loom checkpointing={mode}: {tps:.0f} tokens/s, peak {peak:.2f} GiB, predicted {predicted:.2f} GiB "
          f"({100 * (predicted - peak) / peak:+.1f}%)")
worst = max(abs(a - b) / abs(b) for a, b in zip(losses["every-layer"], losses["none"]))
print(f"loom losses with vs without checkpointing: largest relative difference {worst:.2e} over {len(losses['none'])} logged steps")
PY
python3 bench/hf_peft_lora.py --steps 20 --warmup 5 --lora-dtype bf16 --json "$out/hf-bf16.json"
python3 bench/hf_peft_lora.py --steps 20 --warmup 5 --lora-dtype bf16 --gradient-checkpointing --json "$out/hf-bf16-ckpt.json"

#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-build.sh: loom and HF transformers + PEFT train LoRA r=16
# on the same random-init Llama-3-8B shape, bf16, batch 4 x 1024, on cuda:0, one after the other
# in this one call. Prints both; writes bench/out/{loom,hf}.json.
#   bench/run_h200.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out=bench/out
rm -rf "$out" && mkdir -p "$out"
python3 bench/make_bench_data.py  # every row fills max_length = 1024 tokens
"$build/bin/loom" run bench/llama8b_lora.toml --output "$out/loom-run" --log-level warn
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/loom-run/metrics.jsonl") if l.strip()]
train = [r for r in rows if not r.get("eval")]
timed = [r for r in train if r["step"] > 10]  # the first steps warm up kernels and the allocator
tps = sum(r["tokens_per_s"] for r in timed) / len(timed)
peak = max(max(r.get("peak_memory_bytes", {"-": 0}).values()) for r in train) / 2**30
json.dump({"tokens_per_s": tps, "peak_gib": peak, "rows": train}, open(f"{out}/loom.json", "w"), indent=1)
print(f"loom: {tps:.0f} tokens/s, peak {peak:.1f} GiB (mean of steps 11-30)")
PY
python3 bench/hf_peft_lora.py --steps 20 --warmup 5 --json "$out/hf.json"
python3 bench/hf_peft_lora.py --steps 20 --warmup 5 --lora-dtype bf16 --json "$out/hf-bf16.json"

#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-build.sh: a GRPO step (issue 54), loom beside a plain
# PyTorch loop with transformers' generate (static cache) and PEFT, in one call, on a random-init
# Llama-3-8B shape, LoRA r=16, 8 prompts x 8 completions of 256 tokens, beta 0.04.
#   loom: bench/llama8b_grpo.toml, 6 steps; its metrics rows give each step's time/generation_s,
#         time/reference_s and time/update_s.
#   peer: bench/hf_grpo.py, 4 steps, the same split.
# Steps after the first are averaged (the first warms kernels, captures graphs, compiles).
#   bench/run_grpo.sh [BUILD_DIR] [PARTS]   (PARTS: any of loom hf; default both)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
parts=${2-loom hf}
out=bench/out-grpo
mkdir -p "$out"
python3 -c "
import json, random
r = random.Random(0)
with open('$out/prompts.jsonl', 'w') as f:
    for i in range(64):
        f.write(json.dumps({'prompt': ''.join(r.choice('abcdefghijklmnopqrstuvwxyz ') for _ in range(49))}) + '\n')
"
for part in $parts; do
  case $part in
    loom)
      rm -rf "$out/loom-run"
      timeout "${LOOM_RUN_TIMEOUT:-500}" "$build/bin/loom" run bench/llama8b_grpo.toml --output "$out/loom-run" > "$out/loom.log" 2>&1 ||
        echo "loom failed (exit $?): see $out/loom.log" ;;
    hf)
      timeout "${LOOM_HF_TIMEOUT:-900}" python3 bench/hf_grpo.py --steps 4 --out "$out/hf.json" > "$out/hf.log" 2>&1 || echo "hf_grpo failed (exit $?): see $out/hf.log" ;;
  esac
done
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
parts = ("generation_s", "reference_s", "update_s")
def show(name, mean):
    total = sum(mean[p] for p in parts)
    print(f"{name:6s} step {total:7.2f} s  " + "  ".join(f"{p[:-2]} {mean[p]:6.2f} s" for p in parts))
    return total
loom = hf = None
path = f"{out}/loom-run/metrics.jsonl"
if os.path.exists(path):
    rows = [json.loads(l) for l in open(path) if '"eval"' not in l]
    rows = [r for r in rows if "time/update_s" in r][1:]
    if rows:
        loom = show("loom", {p: sum(r["time/" + p] for r in rows) / len(rows) for p in parts})
        peak = max(max(r.get("peak_memory_bytes", {"-": 0}).values()) for r in rows) / 2**30
        print(f"loom peak {peak:.1f} GiB")
if os.path.exists(f"{out}/hf.json"):
    j = json.load(open(f"{out}/hf.json"))
    hf = show("hf", j["mean_after_first"])
    print(f"hf peak {j['peak_gib']:.1f} GiB ({j['gpu']}, torch {j['torch']})")
if loom and hf:
    print(f"loom is {hf / loom:.2f}x the peer's speed")
PY

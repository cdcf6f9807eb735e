#!/usr/bin/env bash
# On the GPU machine, after a build (issue 52): what stands for a T4 here. Writes bench/out-gpus/.
#  1. bf16 LoRA on the 8B shape (bench/llama8b_lora.toml), 30 steps, every step's loss: the reference.
#  2. The same pipeline with dtype = "auto" in 7.5 mode (LOOM_DEVICE_CAPABILITY=7.5: auto takes fp16,
#     trained with loss scaling), and in fp32: every step's loss of fp16 and of bf16 against fp32's
#     (fp16 came within 1.3e-4, bf16 1.65e-2: bench/RESULTS.md).
#  3. configs/t4x2_qlora.toml: its plan on two simulated T4s ("cuda:0=15GiB@7.5,cuda:1=15GiB@7.5"),
#     then on this one GPU in 7.5 mode, capped at 15 GiB by its [run] gpu_memory, 30 steps of 4 rows of
#     up to 1024 tokens of the bench text: peak against the plan (goal: under 15 GiB, within 10%).
# Build with LOOM_CUDA_ARCHITECTURES=75-virtual for the kernels' 7.5 code (scripts/gpu-suite.sh
# BUILD 7.5 does); run 1 then runs the same kernels' code (loom's kernels choose by the code's
# capability) with LibTorch's own as on this GPU.
#   bench/run_gpus.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out=bench/out-gpus
rm -rf "$out" && mkdir -p "$out"
python3 bench/make_bench_data.py 400
loom="$build/bin/loom"
"$loom" --version > "$out/version.txt"
run() {  # NAME PIPELINE SETTINGS...
  local name=$1 pipeline=$2
  shift 2
  "$loom" plan "$pipeline" --json "$@" > "$out/plan-$name.json" 2> "$out/plan-$name.err" || echo "plan $name failed: see $out/plan-$name.err"
  timeout "${LOOM_RUN_TIMEOUT:-400}" "$loom" run "$pipeline" --output "$out/$name" --log-level info "$@" > "$out/$name.log" 2>&1 ||
    echo "$name failed (exit $?): see $out/$name.log"
}
every_step=(--set train.log_every=1)
LOOM_DEVICE_CAPABILITY= run bf16 bench/llama8b_lora.toml "${every_step[@]}"
LOOM_DEVICE_CAPABILITY=7.5 run fp16 bench/llama8b_lora.toml "${every_step[@]}" --set 'run.dtype="auto"'
LOOM_DEVICE_CAPABILITY= run fp32 bench/llama8b_lora.toml "${every_step[@]}" --set 'run.dtype="fp32"'
LOOM_DEVICE_CAPABILITY=7.5 "$loom" plan configs/t4x2_qlora.toml --devices "cuda:0=15GiB@7.5,cuda:1=15GiB@7.5,cpu=12GiB" > "$out/plan-t4x2.txt" 2>&1 ||
  echo "the two-T4 plan failed: see $out/plan-t4x2.txt"
bench_text=(--set "data.train=\"$PWD/bench/bench-data.jsonl\"" --set 'data.format="### PROMPT: continue\n### OUTPUT: {text}"')
LOOM_DEVICE_CAPABILITY=7.5 run t4 configs/t4x2_qlora.toml "${every_step[@]}" "${bench_text[@]}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>/dev/null || true
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
def rows(name):
    path = f"{out}/{name}/metrics.jsonl"
    if not os.path.exists(path):
        return None
    return [r for r in (json.loads(l) for l in open(path) if l.strip()) if not r.get("eval")]
summary = {}
bf16, fp16, fp32 = rows("bf16"), rows("fp16"), rows("fp32")
for name, r in (("bf16", bf16), ("fp16", fp16), ("fp32", fp32)):
    if r:
        timed = [x for x in r if x["step"] > 10] or r
        summary[name] = {"steps": r[-1]["step"], "tokens_per_s": sum(x["tokens_per_s"] for x in timed) / len(timed),
                         "peak_gib": max(max(x.get("peak_memory_bytes", {"-": 0}).values()) for x in r) / 2**30,
                         "losses": [x["loss"] for x in r]}
def worst(a, b):
    return max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b))
if fp16:
    summary["fp16_skipped_steps"] = sum(1 for l in open(f"{out}/fp16.log", errors="replace") if "step skipped" in l)
for a, b in (("fp16", "bf16"), ("fp16", "fp32"), ("bf16", "fp32")):
    if rows(a) and rows(b):
        summary[f"{a}_vs_{b}"] = worst(rows(a), rows(b))
t4 = rows("t4")
if t4:
    peak = max(max(x.get("peak_memory_bytes", {"-": 0}).values()) for x in t4) / 2**30
    entry = {"steps": t4[-1]["step"], "peak_gib": peak, "tokens_per_s": sum(x["tokens_per_s"] for x in t4[5:] or t4) / len(t4[5:] or t4),
             "first_loss": t4[0]["loss"], "last_loss": t4[-1]["loss"]}
    try:
        plan = json.load(open(f"{out}/plan-t4.json"))
        entry["predicted_gib"] = plan["devices"][0]["total_bytes"] / 2**30
        entry["dtype"] = plan["dtype"]
        entry["plan_vs_peak"] = (entry["predicted_gib"] - peak) / peak
    except (OSError, ValueError, KeyError, IndexError):
        pass
    summary["t4"] = entry
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
for name in ("bf16", "fp16", "fp32"):
    if name in summary:
        s = summary[name]
        print(f"{name}: {s['steps']} steps, {s['tokens_per_s']:.0f} tokens/s, peak {s['peak_gib']:.2f} GiB, loss {s['losses'][0]:.4f} -> {s['losses'][-1]:.4f}")
for key in ("fp16_vs_bf16", "fp16_vs_fp32", "bf16_vs_fp32"):
    if key in summary:
        print(f"{key.replace('_vs_', ' (every step) against ')}: worst relative loss difference {summary[key]:.2e}")
if "fp16_skipped_steps" in summary:
    print(f"fp16: {summary['fp16_skipped_steps']} steps skipped by the loss scaler")
if "t4" in summary:
    s = summary["t4"]
    line = f"t4x2_qlora on one GPU capped at 15 GiB (7.5 mode, {s.get('dtype', '?')}): {s['steps']} steps, {s['tokens_per_s']:.0f} tokens/s, peak {s['peak_gib']:.2f} GiB"
    if "predicted_gib" in s:
        line += f", plan {s['predicted_gib']:.2f} GiB ({100 * s['plan_vs_peak']:+.1f}%)"
    print(line + f", loss {s['first_loss']:.3f} -> {s['last_loss']:.3f}")
PY

#!/usr/bin/env bash
# On nvidia-h200, after scripts/gpu-build.sh: QLoRA (#14) in one call.
#  0. loom_dequantize_bench: the dequantization kernel per weight shape against a device copy.
#  1. The 8B shape (bench/llama8b_lora.toml: r 16 on every projection, bf16, batch 4 x 1024): loom's
#     bf16 LoRA, then the same run with adapter qlora (NF4, double quantization); tokens/s, peak,
#     and the quantized linears' bytes per parameter (the trainer's "4-bit base" line and the plan).
#  2. The 70B shape, QLoRA r 16 with activation checkpointing, batch 1 x 1024, 20 steps
#     (bench/llama70b_qlora.toml): predicted against measured peak, tokens/s.
#  3. The seeds' card: 8B QLoRA, batch 4 x 1024 with checkpointing, auto placement capped at 15 GiB
#     (bench/llama8b_qlora_15gib.toml).
#  4. Generation (greedy, 1 and 4 prompts): bf16 LoRA and QLoRA on the 8B shape, QLoRA on the 70B
#     one; loom generate's own timing line (prompt pass, then ms a step).
# bitsandbytes is not on the machine, so no Python QLoRA runs beside it. Writes bench/out-qlora/.
#   bench/run_qlora.sh [BUILD_DIR] [PARTS]   (PARTS: any of 8b 70b card gen; default all four)
# LOOM_RUN_TIMEOUT (seconds, default 600) bounds each run, so one that hangs leaves the others' numbers.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
parts=${2:-8b 70b card gen}
out=bench/out-qlora
rm -rf "$out" && mkdir -p "$out"
python3 bench/make_bench_data.py 400
loom="$build/bin/loom"
run() {  # NAME PIPELINE SETTINGS...: the plan (JSON), then the run, logging at info for the 4-bit line
  local name=$1 pipeline=$2
  shift 2
  "$loom" plan "$pipeline" --json "$@" > "$out/plan-$name.json" 2> "$out/plan-$name.err" || echo "plan $name failed: see $out/plan-$name.err"
  local start=$(date +%s.%N)
  timeout "${LOOM_RUN_TIMEOUT:-600}" "$loom" run "$pipeline" --output "$out/$name" --log-level info "$@" > "$out/$name.log" 2>&1 ||
    echo "$name failed (exit $?): see $out/$name.log"
  echo "$start $(date +%s.%N)" > "$out/$name.s"
}
# The kernel alone: dequantizing each shape's 4-bit weight beside a device copy of its bf16 bytes.
"$build/bin/loom_dequantize_bench" | tee "$out/dequantize.txt" || echo "loom_dequantize_bench failed"
gen() {  # NAME PIPELINE PROMPTS NEW SETTINGS...
  local name=$1 pipeline=$2 prompts=$3 new=$4
  shift 4
  local args=()
  for ((i = 0; i < prompts; i++)); do args+=(--prompt "A:the $i-th prompt of this benchmark, some forty bytes long"); done
  timeout "${LOOM_RUN_TIMEOUT:-600}" "$loom" generate "$pipeline" "${args[@]}" --max-new-tokens "$new" --log-level info "$@" \
    > "$out/gen-$name.log" 2>&1 || echo "generate $name failed (exit $?): see $out/gen-$name.log"
}
qlora=(--set 'adapter.plugin="qlora"' --set 'adapter.quant_type="nf4"' --set adapter.double_quant=true)
for part in $parts; do
  case $part in
    8b) run lora8b bench/llama8b_lora.toml
        run qlora8b bench/llama8b_lora.toml "${qlora[@]}" ;;
    70b) run qlora70b bench/llama70b_qlora.toml ;;
    card) run card bench/llama8b_qlora_15gib.toml ;;
    gen) for prompts in 1 4; do
           gen lora8b-x$prompts bench/llama8b_lora.toml $prompts 129
           gen qlora8b-x$prompts bench/llama8b_lora.toml $prompts 129 "${qlora[@]}"
           gen qlora70b-x$prompts bench/llama70b_qlora.toml $prompts 65
         done ;;
  esac
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>/dev/null || true
python3 - "$out" <<'PY'
import json, os, re, sys
out = sys.argv[1]
def summary(name):
    path = f"{out}/{name}/metrics.jsonl"
    if not os.path.exists(path):
        return None
    rows = [json.loads(l) for l in open(path) if l.strip()]
    train = [r for r in rows if not r.get("eval")]
    last = train[-1]["step"]
    timed = [r for r in train if r["step"] > min(10, last // 2)] or train  # early steps warm kernels and the allocator
    peak = max(max(r.get("peak_memory_bytes", {"-": 0}).values()) for r in train) / 2**30
    result = {"steps": last, "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed), "peak_gib": peak,
              "first_loss": train[0]["loss"], "last_loss": train[-1]["loss"]}
    try:
        plan = json.load(open(f"{out}/plan-{name}.json"))
        result["predicted_gib"] = plan["devices"][0]["total_bytes"] / 2**30
        result["plan_layer_bytes_per_parameter"] = plan["model"].get("layer_bytes_per_parameter")
        result["devices"] = sorted({b["device"] for b in plan["blocks"]})
    except (OSError, ValueError, KeyError, IndexError):
        pass
    found = re.search(r"4-bit base: (\d+) linears, (\d+) parameters stored in (\d+) bytes", open(f"{out}/{name}.log", errors="replace").read())
    if found:
        result["four_bit_linears"] = int(found[1])
        result["quantized_bytes_per_parameter"] = int(found[3]) / int(found[2])
    start, end = map(float, open(f"{out}/{name}.s").read().split())
    result["wall_s"] = end - start
    return result
runs = {name: summary(name) for name in ("lora8b", "qlora8b", "qlora70b", "card") if os.path.exists(f"{out}/{name}.s")}
json.dump(runs, open(f"{out}/summary.json", "w"), indent=1)
base = (runs.get("lora8b") or {}).get("tokens_per_s")
for name, r in runs.items():
    if r is None:
        print(f"{name}: failed (see {out}/{name}.log)")
        continue
    line = f"{name}: {r['steps']} steps, {r['tokens_per_s']:.0f} tokens/s"
    if base and name != "lora8b" and name.endswith("8b"):
        line += f" ({r['tokens_per_s'] / base:.2f}x bf16 LoRA)"
    line += f", peak {r['peak_gib']:.2f} GiB"
    if "predicted_gib" in r:
        line += f", predicted {r['predicted_gib']:.2f} GiB ({100 * (r['predicted_gib'] - r['peak_gib']) / r['peak_gib']:+.1f}%)"
    if "quantized_bytes_per_parameter" in r:
        line += f", {r['four_bit_linears']} 4-bit linears at {r['quantized_bytes_per_parameter']:.4f} bytes/parameter"
    if r.get("plan_layer_bytes_per_parameter"):
        line += f" (plan: decoder layers {r['plan_layer_bytes_per_parameter']:.3f})"
    if "devices" in r:
        line += f", on {'+'.join(r['devices'])}"
    line += f", loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}, {r['wall_s']:.0f} s wall"
    print(line)
timing = re.compile(r"prompt pass ([\d.]+) s, then (\d+) step\(s\) at ([\d.]+) ms each \(([\d.]+) new tokens/s\)")
generation = {}
for name in ("lora8b", "qlora8b", "qlora70b"):
    for prompts in (1, 4):
        path = f"{out}/gen-{name}-x{prompts}.log"
        if not os.path.exists(path):
            continue
        # The generated text is whatever bytes the tokenizer decodes to, not always UTF-8.
        found = timing.search(open(path, errors="replace").read())
        generation[f"{name}-x{prompts}"] = {"prompt_s": float(found[1]), "steps": int(found[2]), "ms_per_step": float(found[3]),
                                             "new_tokens_per_s": float(found[4])} if found else None
for name, g in generation.items():
    base = generation.get(name.replace("qlora70b", "lora8b").replace("qlora8b", "lora8b"))
    if g is None:
        print(f"generate {name}: failed (see {out}/gen-{name}.log)")
        continue
    ratio = f" ({base['ms_per_step'] / g['ms_per_step']:.2f}x the bf16 8B step)" if base and name.startswith("qlora8b") else ""
    print(f"generate {name}: {g['ms_per_step']:.2f} ms a step over {g['steps']} steps, {g['new_tokens_per_s']:.1f} new tokens/s{ratio}, "
          f"prompt pass {g['prompt_s']:.3f} s")
runs["generate"] = generation
json.dump(runs, open(f"{out}/summary.json", "w"), indent=1)
PY

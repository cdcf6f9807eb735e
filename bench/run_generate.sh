#!/usr/bin/env bash
# On nvidia-h200, after scripts/gpu-build.sh: generation (#27), loom beside HF transformers on the
# same GPU in one call. Greedy, random-init weights, the bytes tokenizer (prompts of 50 tokens).
#  loom: ms per decode step at 1, 4, 16 and 64 prompts (its own timing line, after the warm-up steps
#        that capture the CUDA graph), new tokens per second, the prompt pass at 128 and 2,048
#        tokens (after an untimed --warmup run), peak memory; the 8B bf16, the 8B on a 4-bit base, the 70B on a 4-bit base; and the
#        8B bf16 with --eager (op by op) for the graph's share.
#  hf:   bench/hf_generate.py on the 8B bf16: default (dynamic) cache and cache_implementation="static".
#   bench/run_generate.sh [BUILD_DIR] [PARTS]   (PARTS: any of loom prefill hf; default all three; "" only the table)
# LOOM_RUN_TIMEOUT (seconds, default 400) bounds each run. Writes bench/out-generate/.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
parts=${2-loom prefill hf}  # "" prints the table of what is there
out=bench/out-generate
mkdir -p "$out"
loom="$build/bin/loom"
prompt50="the prompt of this benchmark, fifty bytes long ."   # 49 bytes + BOS = 50 tokens
gen() {  # NAME PIPELINE PROMPTS NEW PROMPT SETTINGS...
  local name=$1 pipeline=$2 prompts=$3 new=$4 text=$5
  shift 5
  local args=()
  for ((i = 0; i < prompts; i++)); do args+=(--prompt "$text"); done
  /usr/bin/time -f "%M" -o "$out/gen-$name.rss" timeout "${LOOM_RUN_TIMEOUT:-400}" "$loom" generate "$pipeline" "${args[@]}" \
    --max-new-tokens "$new" --rows 64 --ignore-eos --log-level info "$@" > "$out/gen-$name.log" 2>&1 || echo "generate $name failed (exit $?): see $out/gen-$name.log"
}
long_prompt() { python3 -c "import sys; print(('loom ' * 1000)[: int(sys.argv[1])], end='')" "$1"; }
qlora=(--set 'adapter.plugin="qlora"' --set 'adapter.quant_type="nf4"' --set adapter.double_quant=true)
for part in $parts; do
  case $part in
    loom)
      for prompts in 1 4 16 64; do
        gen 8b-x$prompts bench/llama8b_lora.toml $prompts 160 "$prompt50"
        gen 8b4bit-x$prompts bench/llama8b_lora.toml $prompts 160 "$prompt50" "${qlora[@]}"
      done
      gen 8b-eager-x1 bench/llama8b_lora.toml 1 160 "$prompt50" --eager
      gen 70b4bit-x1 bench/llama70b_qlora.toml 1 96 "$prompt50" ;;
    prefill)
      gen 8b-prefill128 bench/llama8b_lora.toml 1 2 "$(long_prompt 127)" --warmup
      gen 8b-prefill2048 bench/llama8b_lora.toml 1 2 "$(long_prompt 2047)" --warmup ;;
    hf)
      timeout "${LOOM_HF_TIMEOUT:-900}" python3 bench/hf_generate.py --shape 8b --prompts 1 4 64 16 --out "$out/hf-8b.json" > "$out/hf-8b.log" 2>&1 ||
        echo "hf_generate failed (exit $?): see $out/hf-8b.log" ;;
  esac
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>/dev/null || true
python3 - "$out" <<'PY'
import glob, json, os, re, sys
out = sys.argv[1]
timing = re.compile(r"prompt pass ([\d.]+) s, then (\d+) step\(s\) at ([\d.]+) ms each \(([\d.]+) new tokens/s\)")
peak = re.compile(r"generate: peak ([\d.]+) GiB allocated")
rows = {}
for path in sorted(glob.glob(f"{out}/gen-*.log")):
    name = os.path.basename(path)[4:-4]
    text = open(path, errors="replace").read()  # the bytes tokenizer decodes to bytes that need not be UTF-8
    found = timing.findall(text)  # the last line: the timed run after any --warmup one
    if not found:
        rows[name] = None
        continue
    prompt_s, steps, ms, rate = found[-1]
    rows[name] = {"prompt_s": float(prompt_s), "steps": int(steps), "ms_per_step": float(ms), "new_tokens_per_s": float(rate)}
    if (p := peak.findall(text)):
        rows[name]["peak_gib"] = float(p[-1])
hf = json.load(open(f"{out}/hf-8b.json")) if os.path.exists(f"{out}/hf-8b.json") else None
summary = {"loom": rows, "hf": hf}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print("| | " + " | ".join(f"{n} prompt(s)" for n in (1, 4, 16, 64)) + " |")
print("|---|" + "---:|" * 4)
def cell(r):
    return "-" if not r or "ms_per_step" not in r else f"{r['ms_per_step']:.2f} ms ({r['new_tokens_per_s']:,.0f} tok/s)"
for label, key in (("loom 8B bf16", "8b"), ("loom 8B 4-bit base", "8b4bit")):
    print(f"| {label} | " + " | ".join(cell(rows.get(f"{key}-x{n}")) for n in (1, 4, 16, 64)) + " |")
if hf:
    for cache in ("dynamic", "static"):
        print(f"| HF 8B bf16, {cache} cache | " + " | ".join(cell(hf["steps"].get(f"{cache}-x{n}")) for n in (1, 4, 16, 64)) + " |")
for name in ("8b-eager-x1", "70b4bit-x1"):
    print(f"{name}: {cell(rows.get(name))}" + (f", peak {rows[name]['peak_gib']:.1f} GiB" if rows.get(name) and "peak_gib" in rows[name] else ""))
for length in (128, 2048):
    r = rows.get(f"8b-prefill{length}")
    h = hf["prefill_s"].get(str(length)) if hf else None
    print(f"prompt pass {length} tokens: loom {r['prompt_s']:.3f} s" if r else f"prompt pass {length}: loom -", end="")
    print(f", HF {h:.3f} s" if h else "")
if hf:
    print(f"HF peak {hf['peak_gib']:.1f} GiB; torch {hf['torch']}, transformers {hf['transformers']}")
PY

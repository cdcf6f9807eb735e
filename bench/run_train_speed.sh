#!/usr/bin/env bash
# On nvidia-h200, after scripts/gpu-build.sh: training speed (#28), loom beside HF transformers + PEFT
# with bf16 adapters (HF's fastest setup that runs there) in one call. Random-init shapes, LoRA r16
# on the seven projections, bf16, one GPU, no activation checkpointing.
#   varlen  variable-length instruction data (bench/make_instruct_lengths.py), 8 samples a step:
#           loom with [data] packing (rows of 2,048) and padded; HF padded per batch, and HF
#           padding-free (its samples end to end, positions restarting) if its own check finds
#           attention kept inside each sample.
#   rows    full rows: the 8B at 4 x 1024, 8 x 1024 and 2 x 4096; the 1B (tied) at 8 x 1024.
#   qlora   the 8B on a 4-bit base (NF4, double quantization) at 4 x 1024, and again with activation
#           checkpointing on every layer.
#   gemma3  Gemma 3 4B's language model (bench/gemma3_4b/config.json, bench/gemma3_4b_lora.toml) at 4 x 1024.
# Reports real (non-pad) tokens/s, peak memory, MFU (model FLOPs of the real tokens a second over
# 989 TFLOP/s, the H200's dense bf16 peak; FLOPs as in the summary below) and loom's plan against its
# measured peak. Writes bench/out-speed/.
#   bench/run_train_speed.sh [BUILD_DIR] [PARTS]   (PARTS: any of varlen rows qlora gemma3, default the first three;
#                                                  varlen-loom: varlen without HF's runs;
#                                                  "summary" only prints the table of what is there)
# LOOM_RUN_TIMEOUT and LOOM_HF_TIMEOUT (seconds, default 900) bound each run.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
parts=${2:-varlen rows qlora}
out=bench/out-speed
mkdir -p "$out"
loom="$build/bin/loom"
loom_run() {  # NAME SETTINGS...: the plan, then 30 steps (the summary times steps 11 to 30) of $pipeline
  local name=$1 pipeline=${pipeline:-bench/llama8b_lora.toml}
  shift
  rm -rf "$out/loom-$name"
  "$loom" plan "$pipeline" --json "$@" > "$out/plan-$name.json" 2> "$out/plan-$name.log" || echo "plan $name failed: see $out/plan-$name.log"
  timeout "${LOOM_RUN_TIMEOUT:-900}" "$loom" run "$pipeline" --output "$out/loom-$name" --log-level warn "$@" > "$out/loom-$name.log" 2>&1 ||
    echo "loom $name failed (exit $?): see $out/loom-$name.log"
}
hf_run() {  # NAME ARGS...: 5 untimed steps, then 20 timed
  local name=$1
  shift
  timeout "${LOOM_HF_TIMEOUT:-900}" python3 bench/hf_peft_lora.py --steps 20 --warmup 5 --lora-dtype bf16 --json "$out/hf-$name.json" "$@" \
    > "$out/hf-$name.log" 2>&1 || echo "hf $name failed (exit $?): see $out/hf-$name.log"
}
one_b=(--set model.hidden_size=2048 --set model.intermediate_size=8192 --set model.num_hidden_layers=16 --set model.tie_word_embeddings=true)
for part in $parts; do
  case $part in
    varlen | varlen-loom)
      python3 bench/make_instruct_lengths.py --count 4000 --lengths "$out/lengths.jsonl" --loom "$out/instruct.jsonl" > "$out/lengths.txt"
      varlen=(--set "data.train=\"$PWD/$out/instruct.jsonl\"" --set 'data.format="Q:{q} A:{a}"' --set data.max_length=2048 --set train.batch_size=8)
      loom_run varlen-packed "${varlen[@]}" --set data.packing=true
      loom_run varlen-padded "${varlen[@]}"
      [ "$part" = varlen-loom ] && continue
      hf_run varlen-padded --samples "$out/lengths.jsonl" --batch 8
      hf_run varlen-padfree --samples "$out/lengths.jsonl" --batch 8 --padding-free ;;
    rows)
      python3 bench/make_bench_data.py 200 1100
      loom_run 8b-4x1024
      hf_run 8b-4x1024 --batch 4 --seq 1024
      loom_run 8b-8x1024 --set train.batch_size=8
      hf_run 8b-8x1024 --batch 8 --seq 1024
      loom_run 1b-8x1024 "${one_b[@]}" --set train.batch_size=8
      hf_run 1b-8x1024 --shape 1b --batch 8 --seq 1024
      python3 bench/make_bench_data.py 200 4200
      loom_run 8b-2x4096 --set train.batch_size=2 --set data.max_length=4096
      hf_run 8b-2x4096 --batch 2 --seq 4096
      python3 bench/make_bench_data.py 200 1100 ;;
    qlora)
      python3 bench/make_bench_data.py 200 1100
      qlora=(--set 'adapter.plugin="qlora"' --set 'adapter.quant_type="nf4"' --set adapter.double_quant=true)
      loom_run 8b-qlora-4x1024 "${qlora[@]}"
      loom_run 8b-qlora-4x1024-recompute "${qlora[@]}" --set 'train.activation_checkpointing="every-layer"' ;;
    gemma3)
      python3 bench/make_bench_data.py 200 1100
      pipeline=bench/gemma3_4b_lora.toml loom_run gemma3-4b-4x1024
      hf_run gemma3-4b-4x1024 --shape gemma3-4b --batch 4 --seq 1024 ;;
    summary) ;;
    *) echo "run_train_speed: unknown part $part (varlen, varlen-loom, rows, qlora, gemma3 or summary)" >&2; exit 2 ;;
  esac
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>/dev/null || true
python3 - "$out" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
PEAK_FLOPS = 989e12  # H200 dense bf16
SHAPES = {  # hidden, intermediate, layers, q width and kv width (heads x head dim), vocabulary
    "8b": (4096, 14336, 32, 4096, 1024, 128256),
    "1b": (2048, 8192, 16, 2048, 512, 128256),
    "gemma3-4b": (2560, 10240, 34, 2048, 1024, 262208),
}
def flops_per_token(shape, lengths):
    """Model FLOPs per real token: the frozen base's products forward and backward to the input
    (4 x their weights; no weight gradients), LoRA r16's products (8 r (in + out) each: forward,
    input and both weight gradients), causal attention forward and backward (3 x 2 L^2 d_attn a
    layer, spread over the sample's L tokens) for samples of the given lengths."""
    h, i, layers, q, kv, vocab = SHAPES[shape]
    projections = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    base = layers * sum(a * b for a, b in projections) + h * vocab
    lora = layers * sum(8 * 16 * (a + b) for a, b in projections)
    attention = sum(6 * L * L * q * layers for L in lengths) / sum(lengths)
    return 4 * base + lora + attention
def loom_result(name):
    path = f"{out}/loom-{name}/metrics.jsonl"
    if not os.path.exists(path):
        return None
    rows = [json.loads(l) for l in open(path) if l.strip()]
    train = [r for r in rows if not r.get("eval")]
    timed = [r for r in train if r["step"] > 10]  # the first steps warm up kernels and the allocator
    if not timed:
        return None
    result = {"tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed),
              "peak_gib": max(max(r.get("peak_memory_bytes", {"-": 0}).values()) for r in train) / 2**30}
    try:
        result["planned_gib"] = json.load(open(f"{out}/plan-{name}.json"))["devices"][0]["total_bytes"] / 2**30
    except (OSError, ValueError, KeyError, IndexError):
        pass
    return result
def hf_result(name):
    path = f"{out}/hf-{name}.json"
    return json.load(open(path)) if os.path.exists(path) else None
lengths = []
if os.path.exists(f"{out}/lengths.jsonl"):
    lengths = [sum(json.loads(l).values()) for l in open(f"{out}/lengths.jsonl") if l.strip()]
runs = [("varlen", "8B, instruction lengths, 8 samples a step", "varlen-packed", "varlen-padded", "8b", lengths),
        ("varlen-loom-padded", "8B, instruction lengths, loom padded", "varlen-padded", None, "8b", lengths),
        ("varlen-padfree", "8B, instruction lengths, HF padding-free", None, "varlen-padfree", "8b", lengths),
        ("8b-4x1024", "8B, 4 x 1024", "8b-4x1024", "8b-4x1024", "8b", [1024]),
        ("8b-8x1024", "8B, 8 x 1024", "8b-8x1024", "8b-8x1024", "8b", [1024]),
        ("8b-2x4096", "8B, 2 x 4096", "8b-2x4096", "8b-2x4096", "8b", [4096]),
        ("1b-8x1024", "1B, 8 x 1024", "1b-8x1024", "1b-8x1024", "1b", [1024]),
        ("gemma3-4b-4x1024", "Gemma 3 4B, 4 x 1024", "gemma3-4b-4x1024", "gemma3-4b-4x1024", "gemma3-4b", [1024]),
        ("8b-qlora", "8B QLoRA (NF4), 4 x 1024", "8b-qlora-4x1024", None, "8b", [1024]),
        ("8b-qlora-recompute", "8B QLoRA (NF4), 4 x 1024, activation checkpointing every layer", "8b-qlora-4x1024-recompute", None, "8b", [1024])]
summary = {}
print("| run | loom tokens/s | loom peak GiB (plan) | loom MFU | HF tokens/s | HF peak GiB | HF MFU | loom / HF |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for key, label, loom_name, hf_name, shape, lens in runs:
    l = loom_result(loom_name) if loom_name else None
    h = hf_result(hf_name) if hf_name else None
    if not l and not h or not lens:
        continue
    f = flops_per_token(shape, lens)
    row = {"loom": l, "hf": h, "flops_per_token": f}
    summary[key] = row
    cells = [label]
    if l:
        plan = f" ({l['planned_gib']:.1f}, {100 * (l['planned_gib'] - l['peak_gib']) / l['peak_gib']:+.0f}%)" if "planned_gib" in l else ""
        cells += [f"{l['tokens_per_s']:,.0f}", f"{l['peak_gib']:.1f}{plan}", f"{100 * l['tokens_per_s'] * f / PEAK_FLOPS:.1f}%"]
    else:
        cells += ["-", "-", "-"]
    if h:
        note = "" if h.get("padding_free_exact") in (None, True) else " (samples see each other: not a valid peer)"
        cells += [f"{h['tokens_per_s']:,.0f}{note}", f"{h['peak_mem_gib']:.1f}", f"{100 * h['tokens_per_s'] * f / PEAK_FLOPS:.1f}%"]
    else:
        cells += ["-", "-", "-"]
    cells.append(f"{l['tokens_per_s'] / h['tokens_per_s']:.2f}x" if l and h else "-")
    print("| " + " | ".join(cells) + " |")
bf16, qlora = summary.get("8b-4x1024", {}).get("loom"), summary.get("8b-qlora", {}).get("loom")
if bf16 and qlora:
    print(f"QLoRA keeps {qlora['tokens_per_s'] / bf16['tokens_per_s']:.2f}x of the bf16 LoRA speed")
if os.path.exists(f"{out}/lengths.txt"):
    print(open(f"{out}/lengths.txt").read().strip())
gpu = open(f"{out}/gpu.txt").read().strip() if os.path.exists(f"{out}/gpu.txt") else ""
if gpu:
    print("GPU:", gpu)
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
PY

#!/usr/bin/env bash
# On nvidia-h200, after scripts/gpu-build.sh: where one training step's time goes (#28), by Nsight
# Compute (the machine has no Nsight Systems): every kernel of short `loom run`s timed at the GPU's
# own clocks and sorted into the big matmuls, LoRA's small ones, attention, norms, rotary,
# activation, the loss, the optimizer, copies and the rest; one step's share of each beside the
# step's wall time from an unprofiled run of the same pipeline, whose difference is the time no
# kernel ran (launch gaps, host waits). Not yet run (written without device time).
#   bench/profile.sh [BUILD_DIR] [SHAPE] [SETTINGS...]   (SHAPE: 8b (4 x 1024) or 1b (8 x 1024))
# Writes bench/out-profile/: kernels-SHAPE-{2,3}.csv (ncu's raw rows), profile-SHAPE.json, and prints
# the table for bench/RESULTS.md.
# How kernels are told apart: by name (cuBLAS/CUTLASS products, flash or memory-efficient
# attention, loom's kernels, PyTorch's elementwise and reduction kernels), and products by time: a
# base product of these shapes takes tens of microseconds or more, a LoRA product (rank 16) a few,
# so products under 15 us count as LoRA's; "optimizer" is PyTorch's foreach kernels (AdamW and the
# gradient norm); a rotary or residual sum done by elementwise ops lands in "other". One step's
# time is the difference between runs of 3 and 2 steps, category by category (no marker between
# steps is needed). The synthetic check of the table's arithmetic ran on the CPU machine.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
shape=${2:-8b}
shift 2 2>/dev/null || shift $#
out=bench/out-profile
mkdir -p "$out"
case $shape in
  8b) sets=(--set train.batch_size=4) ;;
  1b) sets=(--set model.hidden_size=2048 --set model.intermediate_size=8192 --set model.num_hidden_layers=16 --set model.tie_word_embeddings=true
            --set train.batch_size=8) ;;
  *) echo "profile: SHAPE is 8b or 1b" >&2; exit 2 ;;
esac
python3 bench/make_bench_data.py 200 1100
run=(bench/llama8b_lora.toml --log-level warn "${sets[@]}" "$@")
# The step's wall time: 30 steps unprofiled, the mean of steps 11 to 30.
rm -rf "$out/wall-$shape"
"$build/bin/loom" run "${run[@]}" --output "$out/wall-$shape" > "$out/wall-$shape.log" 2>&1 || { echo "profile: the unprofiled run failed: $out/wall-$shape.log"; exit 1; }
# Runs of 2 and 3 steps under ncu: one metric, one pass, no replay.
for steps in 2 3; do
  rm -rf "$out/ncu-$shape-$steps"
  timeout "${LOOM_PROFILE_TIMEOUT:-270}" ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw --print-units base \
    "$build/bin/loom" run "${run[@]}" --output "$out/ncu-$shape-$steps" --set "train.max_steps=$steps" > "$out/kernels-$shape-$steps.csv" 2> "$out/ncu-$shape-$steps.log" ||
    { echo "profile: ncu failed or ran out of time: $out/ncu-$shape-$steps.log"; exit 1; }
done
python3 - "$out" "$shape" <<'PY'
import csv, json, re, sys
out, shape = sys.argv[1], sys.argv[2]
CATEGORIES = [
    ("optimizer", re.compile(r"multi_tensor_apply|adam", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|efficient_attention|cutlassF|cutlassB", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|cublas|xmma|nvjet|sm90_|sm80_|splitK|gemv", re.I)),
    ("norm", re.compile(r"rms_norm|norm_kernel|layer_norm", re.I)),
    ("loss", re.compile(r"log_softmax|softmax|nll_loss|cross_entropy|logsumexp", re.I)),
    ("rotary", re.compile(r"rotary", re.I)),
    ("activation", re.compile(r"silu|sigmoid|swiglu|gelu", re.I)),
    ("copies", re.compile(r"copy|cat|fill|memset|memcpy|index|scatter|gather|transpose|CatArray", re.I)),
]
LORA_US = 15.0
def category(name, ns):
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            if label == "matmul":
                return "matmul (LoRA)" if ns < LORA_US * 1e3 else "matmul (base)"
            return label
    return "other elementwise and reductions"
def totals(steps):
    rows = list(csv.reader(l for l in open(f"{out}/kernels-{shape}-{steps}.csv") if l.startswith('"')))
    name_at, time_at = rows[0].index("Kernel Name"), rows[0].index("gpu__time_duration.sum")
    t = {}
    for r in rows[1:]:
        try:
            ns = float(r[time_at])
        except (ValueError, IndexError):
            continue  # the units row
        c = category(r[name_at], ns)
        ms, n = t.get(c, (0.0, 0))
        t[c] = (ms + ns / 1e6, n + 1)
    return t
two, three = totals(2), totals(3)
step = {c: (three.get(c, (0, 0))[0] - two.get(c, (0, 0))[0], three.get(c, (0, 0))[1] - two.get(c, (0, 0))[1]) for c in set(two) | set(three)}
wall_rows = [json.loads(l) for l in open(f"{out}/wall-{shape}/metrics.jsonl") if l.strip()]
timed = [r for r in wall_rows if not r.get("eval") and r["step"] > 10]
tokens_per_s = sum(r["tokens_per_s"] for r in timed) / len(timed)
batch, sequence = (4, 1024) if shape == "8b" else (8, 1024)
wall_ms = 1000.0 * batch * sequence / tokens_per_s
kernel_ms = sum(ms for ms, _ in step.values())
json.dump({"shape": shape, "wall_ms": wall_ms, "kernel_ms": kernel_ms, "tokens_per_s": tokens_per_s,
           "categories": {c: {"ms": ms, "kernels": n} for c, (ms, n) in step.items()}}, open(f"{out}/profile-{shape}.json", "w"), indent=1)
print(f"| {shape}, {batch} x {sequence}: one step | ms | share of the step | kernels |")
print("|---|---:|---:|---:|")
for c, (ms, n) in sorted(step.items(), key=lambda kv: -kv[1][0]):
    print(f"| {c} | {ms:.2f} | {100 * ms / wall_ms:.1f}% | {n} |")
print(f"| no kernel running (the unprofiled step, {wall_ms:.2f} ms, minus the kernels' {kernel_ms:.2f}) | {wall_ms - kernel_ms:.2f} | "
      f"{100 * (wall_ms - kernel_ms) / wall_ms:.1f}% | - |")
PY

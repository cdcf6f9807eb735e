#!/usr/bin/env bash
# On nvidia-h200-x2, after scripts/gpu-build.sh: the seeds' "TP vs PP" as one measured table. The
# 8B shape, LoRA r16, bf16, the same global batch of 4 x 1024 (bench/llama8b_lora.toml) trained by
# loom on one GPU, tensor 2 (each layer split over both GPUs), data 2 (2 x 1024 per GPU) and
# pipeline 2 (1F1B, 2 micro-batches of 2 x 1024); then `loom generate` at 1 GPU, tensor 2 and
# pipeline 2 for 1 and 16 prompts; then the peer, transformers' tp_plan="auto" + PEFT
# (bench/hf_tp_peft.py), whose tokens/s or exact error is recorded. Writes bench/out-tp/.
#   bench/run_tp2.sh [BUILD_DIR] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
steps=${2:-30}
out=bench/out-tp
rm -rf "$out" && mkdir -p "$out"
python3 bench/make_bench_data.py 400
loom="$build/bin/loom"
train() {  # NAME NPROC SETTINGS...
  local name=$1 n=$2
  shift 2
  "$loom" run bench/llama8b_lora.toml --output "$out/$name" --log-level warn --set train.max_steps=$steps "$@" \
    $([ "$n" -gt 1 ] && echo --nproc-per-node "$n") > "$out/$name.log" 2>&1 || echo "$name failed: see $out/$name.log"
}
train one 1
train tp2 2 --set 'placement.plugin="tensor-parallel"' --set parallel.tensor=2
train dp2 2 --set train.batch_size=2
train pp2 2 --set 'placement.plugin="pipeline"' --set 'placement.schedule="1f1b"' --set parallel.pipeline=2 \
  --set train.batch_size=2 --set train.grad_accum=2
# Generation: the time of 129 new tokens less that of 1 (loading cancels out), per layout and batch.
generate() {  # NAME NPROC PROMPTS NEW SETTINGS...
  local name=$1 n=$2 prompts=$3 new=$4
  shift 4
  local args=()
  for ((i = 0; i < prompts; i++)); do args+=(--prompt "A:the $i-th prompt of this benchmark, some forty bytes long"); done
  local start=$(date +%s.%N)
  "$loom" generate bench/llama8b_lora.toml "${args[@]}" --max-new-tokens "$new" --log-level warn "$@" \
    $([ "$n" -gt 1 ] && echo --nproc-per-node "$n") > "$out/gen-$name-$prompts-$new.log" 2>&1 || echo "generate $name failed"
  echo "$start $(date +%s.%N)" > "$out/gen-$name-$prompts-$new.s"
}
for prompts in 1 16; do
  for new in 1 129; do
    generate one 1 $prompts $new
    generate tp2 2 $prompts $new --set 'placement.plugin="tensor-parallel"' --set parallel.tensor=2
    generate pp2 2 $prompts $new --set 'placement.plugin="pipeline"' --set parallel.pipeline=2
  done
done
torchrun --standalone --nproc-per-node 2 bench/hf_tp_peft.py --steps 15 --warmup 5 --json "$out/hf-tp.json" > "$out/hf-tp.log" 2>&1 || true
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
def loom(run):
    path = f"{out}/{run}/metrics.jsonl"
    if not os.path.exists(path):
        return None
    rows = [json.loads(l) for l in open(path) if l.strip() and not json.loads(l).get("eval")]
    timed = [r for r in rows if r["step"] > 10]
    peaks = {}
    for r in rows:
        for d, b in r.get("peak_memory_bytes", {}).items():
            peaks[d] = max(peaks.get(d, 0), b)
    plan = json.load(open(f"{out}/{run}/run.json"))["plan"]
    predicted = [d["total_bytes"] / 2**30 for d in plan["devices"]]
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed), "peak_gib": {d: b / 2**30 for d, b in peaks.items()},
            "predicted_gib": predicted, "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"]}
runs = {name: loom(name) for name in ("one", "tp2", "dp2", "pp2")}
gen = {}
for name in ("one", "tp2", "pp2"):
    for prompts in (1, 16):
        try:
            took = lambda new: (lambda a, b: b - a)(*map(float, open(f"{out}/gen-{name}-{prompts}-{new}.s").read().split()))
            t = took(129) - took(1)
            gen[f"{name} x{prompts}"] = prompts * 128 / t
        except (OSError, ValueError):
            gen[f"{name} x{prompts}"] = None
peer = json.load(open(f"{out}/hf-tp.json")) if os.path.exists(f"{out}/hf-tp.json") else {"error": "no result: see hf-tp.log"}
json.dump({"train": runs, "generate_tokens_per_s": gen, "peer": peer}, open(f"{out}/summary.json", "w"), indent=1)
one = runs["one"]["tokens_per_s"] if runs["one"] else float("nan")
for name, r in runs.items():
    if r is None:
        print(f"{name:4}: failed")
        continue
    peaks = ", ".join(f"{d} {v:.1f}" for d, v in r["peak_gib"].items())
    print(f"{name:4}: {r['tokens_per_s']:8.0f} tokens/s ({r['tokens_per_s'] / one:.2f}x one GPU)  peak GiB {peaks}  "
          f"predicted {', '.join(f'{p:.1f}' for p in r['predicted_gib'])}  loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}")
for k, v in gen.items():
    print(f"generate {k}: " + (f"{v:.1f} new tokens/s" if v else "failed"))
print("peer (transformers tp_plan=auto + PEFT): " + (f"{peer['tokens_per_s']:.0f} tokens/s, peak GiB {peer['peak_mem_gib']}" if "tokens_per_s" in peer
                                                      else "stopped with: " + peer.get("error", "?")))
PY

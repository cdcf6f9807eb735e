#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-build.sh: long rows (issue 69). Llama-3-8B's shape with
# QLoRA r 32 on every projection at batch 1 (bench/llama8b_qlora_15gib.toml with r 32, one GPU,
# every layer recomputed with its input in host memory: activation_checkpointing = "offload"):
#   24gib: an 81,920-token row with [run] gpu_memory = "24GiB" (a 24 GB card), 10 steps;
#   80gib: a 350,000-token row on the whole card, 10 steps;
#   70b:   the 70B shape (bench/llama70b_qlora.toml, r 32), a 90,000-token row, 10 steps;
#   recompute: the 24gib row with "every-layer" instead, which the plan refuses (a control).
# Each: the plan's prediction (JSON), the run's peak (metrics), tokens/s, and the host memory the
# offloaded inputs pinned. Writes bench/out-long/.
#   bench/run_long_context.sh [BUILD_DIR] [PARTS]   (PARTS: any of 24gib 80gib 70b recompute; default 24gib 80gib)
# LOOM_RUN_TIMEOUT (seconds, default 600) bounds each run.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
parts=${2:-24gib 80gib}
out=bench/out-long
rm -rf "$out" && mkdir -p "$out"
loom="$build/bin/loom"
python3 bench/make_bench_data.py 12 360000  # rows longer than the longest max_length below
common=(--set train.batch_size=1 --set train.max_steps=10 --set train.grad_accum=1 --set adapter.r=32 --set adapter.alpha=64
        --set 'train.activation_checkpointing="offload"' --set model.max_position_embeddings=1048576 --set train.log_every=1)
run() {  # NAME PIPELINE SETTINGS...
  local name=$1 pipeline=$2
  shift 2
  "$loom" plan "$pipeline" --json "$@" > "$out/plan-$name.json" 2> "$out/plan-$name.err" || echo "plan $name failed: $(tail -c 600 "$out/plan-$name.err")"
  timeout "${LOOM_RUN_TIMEOUT:-600}" "$loom" run "$pipeline" --output "$out/$name" --log-level info "$@" > "$out/$name.log" 2>&1 ||
    echo "$name failed (exit $?): $(tail -c 800 "$out/$name.log")"
}
for part in $parts; do
  case $part in
    24gib) run 24gib bench/llama8b_qlora_15gib.toml "${common[@]}" --set data.max_length=81920 --set 'run.gpu_memory="24GiB"' \
             --set 'placement.max_memory={"cuda:0"="24GiB"}' ;;
    80gib) run 80gib bench/llama8b_qlora_15gib.toml "${common[@]}" --set data.max_length=350000 --set 'placement.max_memory={"cuda:0"="80GiB"}' ;;
    70b) run 70b bench/llama70b_qlora.toml "${common[@]}" --set data.max_length=90000 ;;
    recompute) run recompute bench/llama8b_qlora_15gib.toml "${common[@]}" --set data.max_length=81920 --set 'run.gpu_memory="24GiB"' \
                 --set 'placement.max_memory={"cuda:0"="24GiB"}' --set 'train.activation_checkpointing="every-layer"' ;;
  esac
done
python3 - "$out" $parts <<'PY'
import json, os, sys
out = sys.argv[1]
for name in sys.argv[2:]:
    metrics = f"{out}/{name}/metrics.jsonl"
    if not os.path.exists(metrics):
        print(f"{name}: no metrics (see {out}/{name}.log)")
        continue
    rows = [json.loads(l) for l in open(metrics) if l.strip()]
    train = [r for r in rows if not r.get("eval") and "loss" in r]
    peak = max(max(r.get("peak_memory_bytes", {"-": 0}).values()) for r in train)
    timed = train[2:] or train
    tps = sum(r.get("tokens_per_s", 0) for r in timed) / len(timed)
    plan = json.load(open(f"{out}/plan-{name}.json"))
    gpu = [d for d in plan["devices"] if d["device"] != "cpu"][0]["total_bytes"]
    host = sum(d["total_bytes"] for d in plan["devices"] if d["device"] == "cpu")
    print(f"{name}: {len(train)} steps, seq {plan['seq_len']}, loss {train[0]['loss']:.3f} -> {train[-1]['loss']:.3f}, "
          f"{tps:.0f} tokens/s, peak {peak / 2**30:.2f} GiB, planned {gpu / 2**30:.2f} GiB ({100 * (gpu - peak) / peak:+.1f}%), "
          f"host planned {host / 2**30:.1f} GiB")
PY

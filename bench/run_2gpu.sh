#!/usr/bin/env bash
# On nvidia-h200-x2, after scripts/gpu-build.sh: bench/llama8b_2gpu.toml trained 50 steps with
# single placement on cuda:0, auto placement over both GPUs and a manual map (single and auto twice,
# alternating, since throughput drifts between runs); then loss curves, predicted vs measured peak
# memory per device and throughput side by side; then the peer, HF transformers + PEFT on the same
# shape on one GPU and over two with accelerate's device_map.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out=bench/out2
rm -rf "$out" && mkdir -p "$out"
python3 - <<'PY'
import json, random
rng = random.Random(1)
words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
with open("bench/bench-2gpu-data.jsonl", "w") as f:
    for _ in range(400):
        n = rng.randint(20, 70)
        text = " ".join(rng.choice(words) for _ in range(n))
        f.write(json.dumps({"instruction": "reverse the words: " + text, "output": " ".join(text.split()[::-1])}) + "\n")
PY
loom="$build/bin/loom"
"$loom" plan bench/llama8b_2gpu.toml > "$out/plan-auto.txt"
cat "$out/plan-auto.txt"
sed -e '/^\[placement\]/,/^$/c\[placement]\nplugin = "single"\ndevice = "cuda:0"\n' bench/llama8b_2gpu.toml > bench/llama8b_single.toml
sed -e '/^\[placement\]/,/^$/c\[placement]\nplugin = "manual"\nmap = { "embed" = "cuda:0", "layers.0-13" = "cuda:0", "layers.14-31" = "cuda:1", "norm" = "cuda:1", "head" = "cuda:1" }\n' \
  bench/llama8b_2gpu.toml > bench/llama8b_manual.toml
for run in single auto manual single-2 auto-2; do
  case $run in single*) toml=bench/llama8b_single.toml ;; auto*) toml=bench/llama8b_2gpu.toml ;; *) toml=bench/llama8b_manual.toml ;; esac
  "$loom" run "$toml" --output "$out/$run" --log-level warn > "$out/$run.log"
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def rows(run):
    return [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl") if l.strip() and not json.loads(l).get("eval")]
ref = rows("single")
for run in ["single", "auto", "manual", "single-2", "auto-2"]:
    r = rows(run)
    plan = json.load(open(f"{out}/{run}/run.json"))["plan"]["devices"]
    peak = {}
    for row in r:
        for d, b in row.get("peak_memory_bytes", {}).items():
            peak[d] = max(peak.get(d, 0), b)
    tps = sum(x["tokens_per_s"] for x in r[10:]) / len(r[10:])
    diff = max(abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-9) for a, b in zip(r, ref))
    print(f"{run}: {len(r)} steps, loss {r[0]['loss']:.4f} -> {r[-1]['loss']:.4f}, max relative loss difference vs single {diff:.2e}, "
          f"{tps:.0f} tokens/s (steps 11-50)")
    for d in plan:
        m = peak.get(d["device"], 0)
        p = d["total_bytes"]
        print(f"  {d['device']}: predicted {p / 2**30:.2f} GiB, measured peak {m / 2**30:.2f} GiB, error {(p - m) / max(m, 1) * 100:+.1f}%")
PY
python3 bench/hf_accelerate_2gpu.py --placement single --json "$out/hf-single.json"
python3 bench/hf_accelerate_2gpu.py --placement device_map --json "$out/hf-device-map.json"

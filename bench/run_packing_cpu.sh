#!/usr/bin/env bash
# [data] packing against padding, side by side on this machine's CPU (#28): a small random-init
# Llama with LoRA, samples of 30 to 500 tokens (the bytes tokenizer; lengths log-normal, median
# about 130, skewed short as instruction data is), 16 samples a micro-batch in rows of 512.
# Prints each run's wall time, final loss and real tokens/s, and the ratio.
#   bench/run_packing_cpu.sh [BUILD_DIR]      (writes bench/out-packing/)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=bench/out-packing
rm -rf "$out" && mkdir -p "$out"
python3 - "$out/train.jsonl" <<'PY'
import json, random, sys
random.seed(1)
with open(sys.argv[1], "w") as f:
    for _ in range(2000):
        n = min(500, max(30, int(random.lognormvariate(4.8, 0.7))))
        q = "".join(random.choice("abcdefgh ") for _ in range(n // 3))
        a = "".join(random.choice("abcdefgh ") for _ in range(n - n // 3))
        f.write(json.dumps({"q": q, "a": a}) + "\n")
PY
cat > "$out/p.toml" <<'TOML'
[run]
seed = 1
[model]
plugin = "llama"
init = "random"
hidden_size = 256
intermediate_size = 512
num_hidden_layers = 4
num_attention_heads = 8
num_key_value_heads = 4
vocab_size = 259
[tokenizer]
plugin = "bytes"
[data]
train = "train.jsonl"
format = "Q:{q} A:{a}"
max_length = 512
[collator]
plugin = "completion-only"
response_template = " A:"
[placement]
plugin = "single"
[train]
batch_size = 16
max_steps = 12
log_every = 4
lr = 1e-3
[adapter]
plugin = "lora"
r = 16
alpha = 32
target_modules = "all-linear"
TOML
declare -A seconds
for packing in false true; do
  start=$(date +%s.%N)
  "$build/bin/loom" run "$out/p.toml" --output "$out/run-$packing" --set "data.packing=$packing" > "$out/log-$packing" 2>&1
  seconds[$packing]=$(python3 -c "import sys; print(round($(date +%s.%N) - $start, 1))")
  python3 - "$out/run-$packing/metrics.jsonl" "$packing" "${seconds[$packing]}" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"eval' not in l]
print(f"packing={sys.argv[2]}: {sys.argv[3]} s for 12 steps, final loss {rows[-1]['loss']:.4f}, {rows[-1]['tokens_per_s']:.0f} real tokens/s")
PY
done
python3 -c "print(f'packed / padded: {${seconds[false]} / ${seconds[true]}:.2f}x faster')"

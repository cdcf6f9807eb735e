#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-build.sh: `auto` with strategy = "cpu_offload" on a 1B
# Llama shape whose cuda:0 is capped so about a third of the blocks are computed on the CPU,
# beside the same pipeline on cuda:0 alone; losses and per-device memory side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out=bench/out3
rm -rf "$out" && mkdir -p "$out"
python3 - <<'PY'
import json, random
rng = random.Random(2)
words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
with open("bench/bench-offload-data.jsonl", "w") as f:
    for _ in range(64):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(10, 30)))
        f.write(json.dumps({"instruction": "reverse: " + text, "output": " ".join(text.split()[::-1])}) + "\n")
PY
base='[run]
seed = 0
dtype = "bf16"
check_devices = true
[model]
plugin = "llama"
init = "random"
hidden_size = 2048
intermediate_size = 8192
num_hidden_layers = 16
num_attention_heads = 32
num_key_value_heads = 8
vocab_size = 32000
[tokenizer]
plugin = "bytes"
padding_side = "left"
pad_token = "eos"
[data]
train = "bench-offload-data.jsonl"
format = "### PROMPT: {instruction}\n### OUTPUT: {output}"
max_length = 256
[collator]
plugin = "completion-only"
response_template = "### OUTPUT:"
[adapter]
plugin = "lora"
r = 16
alpha = 32
target_modules = ["q_proj", "v_proj"]
[train]
batch_size = 2
lr = 1e-3
max_steps = 6
log_every = 1
'
printf '%s[placement]\nplugin = "single"\ndevice = "cuda:0"\n' "$base" > bench/offload_single.toml
printf '%s[placement]\nplugin = "auto"\nstrategy = "cpu_offload"\nmax_memory = { "cuda:0" = "1.9GiB" }\nreserve = "0GiB"\n' "$base" > bench/offload_auto.toml
"$build/bin/loom" plan bench/offload_auto.toml
"$build/bin/loom" run bench/offload_single.toml --output "$out/single" --log-level warn > "$out/single.log"
"$build/bin/loom" run bench/offload_auto.toml --output "$out/offload" --log-level warn > "$out/offload.log"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = lambda run: [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl") if l.strip() and not json.loads(l).get("eval")]
s, o = rows("single"), rows("offload")
for a, b in zip(s, o):
    print(f"step {a['step']}: single {a['loss']:.5f}  offload {b['loss']:.5f}  rel diff {abs(a['loss'] - b['loss']) / a['loss']:.2e}  "
          f"tokens/s single {a['tokens_per_s']:.0f} offload {b['tokens_per_s']:.0f}")
plan = json.load(open(f"{out}/offload/run.json"))["plan"]
cpu = [b["block"] for b in plan["blocks"] if b["device"] == "cpu"]
print(f"offload: {len(cpu)} of {len(plan['blocks'])} blocks on the cpu ({cpu[0]}..{cpu[-1]})")
peak = max(r.get("peak_memory_bytes", {}).get("cuda:0", 0) for r in o)
pred = [d for d in plan["devices"] if d["device"] == "cuda:0"][0]["total_bytes"]
print(f"offload cuda:0: predicted {pred / 2**30:.2f} GiB, measured peak {peak / 2**30:.2f} GiB")
PY

#!/usr/bin/env bash
# On a GPU machine: a run with LoRA dropout on cuda:0 is SIGKILLed after a checkpoint and resumed;
# its losses must repeat the uninterrupted run's, which needs the GPU's random state in the
# checkpoint (dropout on the GPU draws from it).  tests/gpu/resume_dropout.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
loom=${1:-build-gpu}/bin/loom
work=$(mktemp -d)
python3 - "$work" <<'PY'
import json, random, sys
rng = random.Random(5)
with open(sys.argv[1] + "/data.jsonl", "w") as f:
    for _ in range(256):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        f.write(json.dumps({"q": f"{a}+{b}", "a": str(a + b)}) + "\n")
PY
cat > "$work/p.toml" <<'TOML'
[run]
seed = 3
[model]
plugin = "llama"
init = "random"
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
vocab_size = 259
max_position_embeddings = 64
[tokenizer]
plugin = "bytes"
pad_token = "eos"
[data]
train = "data.jsonl"
format = "### PROMPT: {q}\n### OUTPUT: {a}"
max_length = 32
[collator]
plugin = "completion-only"
response_template = "### OUTPUT:"
[adapter]
plugin = "lora"
r = 8
alpha = 16
dropout = 0.5
target_modules = "all-linear"
[placement]
plugin = "single"
device = "cuda:0"
[train]
batch_size = 8
lr = 1e-2
max_steps = 300
log_every = 1
checkpoint_every = 100
TOML
"$loom" run "$work/p.toml" --output "$work/a" --log-level warn > /dev/null
"$loom" run "$work/p.toml" --output "$work/b" --log-level warn > /dev/null &
pid=$!
# Bounded: a run that never checkpoints fails the check instead of hanging it.
for _ in $(seq 2400); do grep -q step "$work/b/checkpoints/latest" 2>/dev/null && break; sleep 0.05; done
grep -q step "$work/b/checkpoints/latest" 2>/dev/null || { kill -9 "$pid"; echo "no checkpoint within 120 s"; exit 1; }
kill -9 "$pid" 2>/dev/null || true
status=0
wait "$pid" 2>/dev/null || status=$?
# The check means something only if the run was cut short.
[ "$status" -eq 137 ] || { echo "the run ended (status $status) before it was killed; make it longer"; exit 1; }
rows=$(grep -c '"loss"' "$work/b/metrics.jsonl")
[ "$rows" -lt 300 ] || { echo "the killed run had logged all 300 steps"; exit 1; }
echo "killed after $(cat "$work/b/checkpoints/latest") ($rows steps logged)"
"$loom" run "$work/p.toml" --output "$work/b" --resume --log-level warn > /dev/null
python3 - "$work" <<'PY'
import json, sys
w = sys.argv[1]
rows = lambda run: [json.loads(l)["loss"] for l in open(f"{w}/{run}/metrics.jsonl") if l.strip() and "loss" in json.loads(l)]
a, b = rows("a"), rows("b")
worst = max(abs(x - y) / max(abs(x), 1e-9) for x, y in zip(a, b))
print(f"{len(a)} vs {len(b)} steps; largest relative loss difference {worst:.2e}")
sys.exit(0 if len(a) == len(b) and worst < 1e-4 else 1)
PY

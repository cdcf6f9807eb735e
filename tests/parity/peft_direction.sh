#!/usr/bin/env bash
# loom -> PEFT: loom trains a LoRA adapter on the `llama` parity fixture, then PEFT loads it with
# PeftModel.from_pretrained and must reproduce loom's logits. Needs python3 with transformers and
# peft (the GPU machine has them) and a build with tests (scripts/gpu-build.sh).
#   tests/parity/peft_direction.sh [BUILD_DIR] [DEVICE]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-gpu}
device=${2:-cuda:0}
fixture=$PWD/tests/fixtures/parity/llama
work=$(mktemp -d)
python3 - "$work" <<'PY'
import json, random, sys
rng = random.Random(0)
with open(f"{sys.argv[1]}/train.jsonl", "w") as f:
    for _ in range(64):
        a = "".join(rng.choice("abcdefgh") for _ in range(6))
        f.write(json.dumps({"q": a, "a": a[::-1]}) + "\n")
PY
cat >"$work/p.toml" <<TOML
[model]
plugin = "llama"
path = "$fixture"
[tokenizer]
plugin = "bytes"
pad_token = "eos"
[data]
train = "train.jsonl"
format = "Q:{q} A:{a}"
max_length = 32
[collator]
plugin = "completion-only"
response_template = " A:"
[adapter]
plugin = "lora"
r = 8
alpha = 16
target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
[placement]
plugin = "single"
device = "$device"
[train]
batch_size = 8
lr = 1e-2
max_steps = 10
log_every = 5
TOML
"$build/bin/loom" run "$work/p.toml" --output "$work/out" --log-level warn
cmake --build "$build" --target loom_logits >/dev/null
"$build/bin/loom_logits" "$fixture" "$fixture/inputs.json" "$work/loom_logits.safetensors" "$work/out/adapter"
python3 tests/parity/check_loom_adapter.py --base "$fixture" --adapter "$work/out/adapter" --inputs "$fixture/inputs.json" \
  --logits "$work/loom_logits.safetensors" --ignore-padding

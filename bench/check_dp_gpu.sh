#!/usr/bin/env bash
# On nvidia-h200-x2, after scripts/gpu-build.sh: a small Llama (fp32, LoRA, no dropout) trained 20
# steps on one GPU with batch 8 and with `--nproc-per-node 2` (NCCL) with batch 4 per GPU must log
# the same losses (within 1e-5 relative), as the CPU test checks over Gloo; and so must two
# pipeline stages over NCCL under each schedule (with activation checkpointing) against one GPU
# with the same 4 micro-batches of 2; and tensor parallelism over the 2 GPUs against one GPU.
#   bench/check_dp_gpu.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out=bench/out-dp-check
rm -rf "$out" && mkdir -p "$out"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
words = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op", "qr", "st", "uv", "wx"]
with open(f"{out}/train.jsonl", "w") as f:
    for i in range(96):
        w = words[i % 12] + words[(i // 12) % 12]
        f.write(json.dumps({"q": w, "a": w}) + "\n")
open(f"{out}/p.toml", "w").write("""[run]
seed = 7
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
padding_side = "left"
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
target_modules = "all-linear"
dropout = 0.0
[placement]
plugin = "single"
device = "cuda:0"
[train]
lr = 1e-2
log_every = 1
max_steps = 20
""")
PY
"$build/bin/loom" run "$out/p.toml" --output "$out/one" --set train.batch_size=8 --log-level warn > "$out/one.log"
"$build/bin/loom" run "$out/p.toml" --output "$out/two" --set train.batch_size=4 --nproc-per-node 2 --log-level warn > "$out/two.log"
"$build/bin/loom" run "$out/p.toml" --output "$out/tp2" --set train.batch_size=8 --set 'placement.plugin="tensor-parallel"' \
  --set parallel.tensor=2 --nproc-per-node 2 --log-level warn > "$out/tp2.log"
micro=(--set train.batch_size=2 --set train.grad_accum=4)
"$build/bin/loom" run "$out/p.toml" --output "$out/one-micro" "${micro[@]}" --log-level warn > "$out/one-micro.log"
for schedule in gpipe 1f1b interleaved-1f1b; do
  "$build/bin/loom" run "$out/p.toml" --output "$out/pp-$schedule" "${micro[@]}" --set 'placement.plugin="pipeline"' \
    --set "placement.schedule=\"$schedule\"" --set parallel.pipeline=2 --set 'train.activation_checkpointing="every-layer"' \
    --nproc-per-node 2 --log-level warn > "$out/pp-$schedule.log"
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = lambda r: [json.loads(l) for l in open(f"{out}/{r}/metrics.jsonl") if l.strip()]
ok = True
for one, other, what in [("one", "two", "one GPU batch 8 vs DP=2 batch 4 (NCCL)"), ("one", "tp2", "one GPU vs tensor 2 (NCCL)")] + [
        ("one-micro", f"pp-{s}", f"one GPU 4 x 2 vs pipeline 2 {s}, checkpointed (NCCL)") for s in ("gpipe", "1f1b", "interleaved-1f1b")]:
    a, b = rows(one), rows(other)
    worst = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b))
    print(f"{what}: {len(a)} steps, loss {a[0]['loss']:.5f} -> {a[-1]['loss']:.5f}, "
          f"largest relative difference {worst:.2e}, peaks {b[-1].get('peak_memory_bytes')}")
    ok = ok and worst <= 1e-5 and len(a) == len(b) == 20
sys.exit(0 if ok else 1)
PY

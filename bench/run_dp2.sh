#!/usr/bin/env bash
# On nvidia-h200-x2, after scripts/gpu-build.sh: data parallelism on the 8B shape, LoRA r16, bf16,
# batch 4 x 1024 per GPU (bench/llama8b_lora.toml). In this one call: loom on one GPU, loom with
# `--nproc-per-node 2` (DP = 2, NCCL), and the peer, PyTorch DDP + PEFT LoRA on HF Llama
# (bench/hf_ddp_peft.py) under torchrun with 1 and 2 processes. Prints a table; writes
# bench/out-dp/*.json.
#   bench/run_dp2.sh [BUILD_DIR] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
steps=${2:-30}
out=bench/out-dp
rm -rf "$out" && mkdir -p "$out"
python3 bench/make_bench_data.py 400  # every row fills max_length = 1024 tokens
loom="$build/bin/loom"
"$loom" run bench/llama8b_lora.toml --output "$out/loom-1" --log-level warn --set train.max_steps=$steps > "$out/loom-1.log"
"$loom" run bench/llama8b_lora.toml --output "$out/loom-2" --log-level warn --set train.max_steps=$steps --nproc-per-node 2 > "$out/loom-2.log"
torchrun --standalone --nproc-per-node 1 bench/hf_ddp_peft.py --steps 15 --warmup 5 --json "$out/ddp-1.json" > "$out/ddp-1.log" 2>&1
torchrun --standalone --nproc-per-node 2 bench/hf_ddp_peft.py --steps 15 --warmup 5 --json "$out/ddp-2.json" > "$out/ddp-2.log" 2>&1
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def loom(run):
    rows = [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl") if l.strip() and not json.loads(l).get("eval")]
    timed = [r for r in rows if r["step"] > 10]  # the first steps warm up kernels and the allocator
    peaks = {}
    for r in rows:
        for d, b in r.get("peak_memory_bytes", {}).items():
            peaks[d] = max(peaks.get(d, 0), b)
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed), "peak_gib": {d: b / 2**30 for d, b in peaks.items()},
            "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"]}
one, two = loom("loom-1"), loom("loom-2")
d1, d2 = json.load(open(f"{out}/ddp-1.json")), json.load(open(f"{out}/ddp-2.json"))
json.dump({"loom-1": one, "loom-2": two, "ddp-1": d1, "ddp-2": d2}, open(f"{out}/summary.json", "w"), indent=1)
fmt = lambda p: ", ".join(f"{k} {v:.1f}" for k, v in p.items())
print(f"loom, 1 GPU:        {one['tokens_per_s']:8.0f} tokens/s  peak GiB {fmt(one['peak_gib'])}")
print(f"loom, DP=2:         {two['tokens_per_s']:8.0f} tokens/s  peak GiB {fmt(two['peak_gib'])}  "
      f"{two['tokens_per_s'] / one['tokens_per_s']:.2f}x one GPU")
print(f"DDP + PEFT, 1 GPU:  {d1['tokens_per_s']:8.0f} tokens/s  peak GiB {', '.join(f'{x:.1f}' for x in d1['peak_mem_gib'])}")
print(f"DDP + PEFT, 2 GPUs: {d2['tokens_per_s']:8.0f} tokens/s  peak GiB {', '.join(f'{x:.1f}' for x in d2['peak_mem_gib'])}  "
      f"{d2['tokens_per_s'] / d1['tokens_per_s']:.2f}x one GPU")
print(f"loom DP=2 / DDP 2 GPUs: {two['tokens_per_s'] / d2['tokens_per_s']:.2f}x")
PY

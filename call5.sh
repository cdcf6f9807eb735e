#!/usr/bin/env bash
cd "$(dirname "$0")"
export LOOM_CUDA_ARCHITECTURES=75-virtual
LOOM_GPU_SKIP_TESTS=1 scripts/gpu-build.sh build-gpu > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
python3 bench/make_bench_data.py 400 >/dev/null
o=bench/out-gpus; mkdir -p $o; L=build-gpu/bin/loom
bt=(--set "data.train=\"$PWD/bench/bench-data.jsonl\"" --set 'data.format="### PROMPT: continue\n### OUTPUT: {text}"' --set train.log_every=1)
LOOM_DEVICE_CAPABILITY=7.5 $L plan configs/t4x2_qlora.toml --json "${bt[@]}" > $o/plan-t4.json 2>$o/plan-t4.err || tail -5 $o/plan-t4.err
LOOM_DEVICE_CAPABILITY=7.5 timeout 200 $L run configs/t4x2_qlora.toml --output $o/t4 --log-level info "${bt[@]}" > $o/t4.log 2>&1 || tail -8 $o/t4.log
grep -i "skipped" $o/t4.log | head -3
python3 - <<'P'
import json
o='bench/out-gpus'
t4=[r for r in (json.loads(l) for l in open(f'{o}/t4/metrics.jsonl') if l.strip()) if not r.get('eval')]
pk=max(max(x['peak_memory_bytes'].values()) for x in t4)/2**30; p=json.load(open(f'{o}/plan-t4.json'))
print('t4 steps', t4[-1]['step'], 'peak', pk, 'plan', p['devices'][0]['total_bytes']/2**30, p['dtype'], 'seq', p['seq_len'], 'tok/s', sum(x['tokens_per_s'] for x in t4[5:])/len(t4[5:]), 'loss', t4[0]['loss'], t4[-1]['loss'])
P

#!/usr/bin/env bash
# On the GPU machine (it has python3 with HF `tokenizers`), after scripts/gpu-build.sh: single-thread
# encode speed of `loom tokenize` (hf-json) and of HF tokenizers on the same ~4 MB of mixed text, per
# tokenizer file, both checked to give the same ids on every line. Then the parity corpus against
# python `tokenizers` (tests/parity/tokenizer_parity.py --reference python), also for every carried family.
#   bench/run_tokenizer.sh BUILD_DIR TOKENIZERS_DIR
# TOKENIZERS_DIR holds <model>/tokenizer.json (+ tokenizer_config.json) for llama3, qwen3, llama2, gemma.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
models=${2:?TOKENIZERS_DIR}
out=bench/out-tok
rm -rf "$out" && mkdir -p "$out"
python3 bench/make_tokenizer_text.py "$out/text.jsonl" 4
export TOKENIZERS_PARALLELISM=false
for m in llama3 qwen3 llama2 gemma gpt2; do
  [ -f "$models/$m/tokenizer.json" ] || continue
  best=""
  for run in 1 2 3; do
    rate=$("$build/bin/loom" tokenize --tokenizer "$models/$m" --file "$out/text.jsonl" --json-lines --no-special --stats 2>&1 >"$out/$m-loom.ids" |
      sed -n 's/.* \([0-9.]*\) MB\/s$/\1/p')
    best=$(python3 -c "print(max(float('$rate'), float('${best:-0}')))")
  done
  start=$(date +%s.%N)
  "$build/bin/loom" tokenize --tokenizer "$models/$m" --no-special "x" >/dev/null
  load=$(python3 -c "import time; print(round(time.time() - $start, 3))")
  hf=$(python3 bench/hf_tokenizers_speed.py "$models/$m/tokenizer.json" "$out/text.jsonl" --ids "$out/$m-hf.ids")
  same=$(python3 - "$out/$m-loom.ids" "$out/$m-hf.ids" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
diff = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
print(f"{len(a)} lines, {diff} differ")
PY
)
  echo "$m: loom $best MB/s (best of 3; whole command incl. load $load s); hf $hf; ids: $same"
done
for m in llama3 qwen3 llama2 gemma gpt2 llama2-metaspace llama2-metaspace-always-split; do
  [ -f "$models/${m%%-*}/tokenizer.json" ] || continue
  python3 tests/parity/tokenizer_parity.py --reference python "$build/bin/loom" "$models" tests/fixtures/tokenizer/corpus.jsonl "$m"
done
# Every carried family (scripts/gpu-tokenizer-families.sh), from .test-data as fetch-gpu-debs.sh packs it.
if [ -d .test-data/npm ]; then
  . scripts/gpu-tokenizer-families.sh
  python3 tests/parity/tokenizer_parity.py --reference python "$build/bin/loom" .test-data tests/fixtures/tokenizer/corpus.jsonl $GPU_TOKENIZER_FAMILIES
fi

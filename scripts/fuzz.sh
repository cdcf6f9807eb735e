#!/usr/bin/env bash
# Runs loom's libFuzzer targets (fuzz/, built with ASan + UBSan by clang into build-fuzz/) over
# their committed seed corpora (fuzz/corpus/<target>/). New interesting inputs collect in
# build-fuzz/corpus/<target>/ (kept between runs, not committed); an input that crashes, hangs or
# trips a sanitizer is saved in build-fuzz/findings/ and the script fails.
#   scripts/fuzz.sh [--runs N | --seconds S] [TARGET...]     (default: every target, 1000 runs)
set -euo pipefail
cd "$(dirname "$0")/.."
limit=(-runs=1000)
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) limit=(-runs="$2"); shift 2 ;;
    --seconds) limit=(-max_total_time="$2"); shift 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(fuzz_pipeline fuzz_model_config fuzz_safetensors fuzz_tokenizer fuzz_jsonl fuzz_peft_adapter fuzz_run_state fuzz_quant_state
  fuzz_run_page)  # fuzz_columnar, fuzz_chat_template: scripts/test-formats.sh, in the formats library's own build
[ -x build-fuzz/bin/${targets[0]} ] || scripts/build-sanitized.sh
mkdir -p build-fuzz/findings
# LibTorch keeps process-lifetime allocations; leaks are not what these runs look for.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
for target in "${targets[@]}"; do
  mkdir -p "build-fuzz/corpus/$target"
  echo "== $target (${limit[*]})"
  # One input at a time, 10 s each at most, no input over 1 MiB, 4 GiB of memory. Chat templates
  # run under tighter bounds of their own (fuzz/fuzz_chat_template.cpp): 5 s and 2 GiB, with
  # Jinja's tokens as the fuzzer's dictionary.
  limits=(-timeout=10 -rss_limit_mb=4096)
  [ "$target" != fuzz_chat_template ] || limits=(-timeout=5 -rss_limit_mb=2048 -dict=fuzz/chat_template.dict)
  build-fuzz/bin/"$target" "${limit[@]}" "${limits[@]}" -max_len=1048576 -print_final_stats=1 \
    -artifact_prefix="build-fuzz/findings/$target-" "build-fuzz/corpus/$target" "fuzz/corpus/$target" 2>&1 |
    grep -E "^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::peak_rss_mb|==[0-9]+==ERROR|SUMMARY|INFO: seed corpus|cov:)" | tail -6 || true
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "fuzz.sh: $target found a problem; see build-fuzz/findings/" >&2; exit 1; }
done

#!/usr/bin/env bash
# The formats library alone (formats/: the data formats' readers, no LibTorch), built with clang
# under AddressSanitizer and UndefinedBehaviorSanitizer into ./build-formats in well under a
# minute: its own tests, then its libFuzzer targets (Parquet/Arrow files, chat templates) over the
# committed seeds. CI's sanitizer stage
# runs it (scripts/test-sanitized.sh); alone it is the quick loop for work on a reader.
#   scripts/test-formats.sh [--runs N | --seconds S]   (default 2000 runs)
set -euo pipefail
cd "$(dirname "$0")/.."
limit=(-runs=2000)
case "${1:-}" in
  --runs) limit=(-runs="$2") ;;
  --seconds) limit=(-max_total_time="$2") ;;
  "") ;;
  *) echo "usage: test-formats.sh [--runs N | --seconds S]" >&2; exit 2 ;;
esac
started=$SECONDS
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/loom-ccache}
CC=clang CXX=clang++ cmake -S formats -B build-formats -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -gline-tables-only -DNDEBUG" \
  -DLOOM_BUILD_TESTS=ON -DLOOM_BUILD_FUZZERS=ON >/dev/null
cmake --build build-formats -j "${LOOM_BUILD_JOBS:-2}"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
build-formats/formats_tests
mkdir -p build-formats/findings
# The limits of scripts/fuzz.sh, and 2 GiB of memory: the readers hold a row group or a record
# batch whatever the file claims. Chat templates under tighter bounds of their own
# (fuzz/fuzz_chat_template.cpp): 5 s and Jinja's tokens as the fuzzer's dictionary.
for target in fuzz_columnar fuzz_chat_template; do
  mkdir -p "build-formats/corpus/$target"
  limits=(-timeout=10 -rss_limit_mb=2048)
  [ "$target" != fuzz_chat_template ] || limits=(-timeout=5 -rss_limit_mb=2048 -dict=fuzz/chat_template.dict)
  echo "== $target (${limit[*]})"
  build-formats/$target "${limit[@]}" "${limits[@]}" -max_len=1048576 -print_final_stats=1 \
    -artifact_prefix="build-formats/findings/$target-" "build-formats/corpus/$target" "fuzz/corpus/$target" 2>&1 |
    grep -E "^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::peak_rss_mb|==[0-9]+==ERROR|SUMMARY|INFO: seed corpus)" | tail -6 || true
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "test-formats.sh: $target found a problem; see build-formats/findings/" >&2; exit 1; }
done
echo "test-formats.sh: $((SECONDS - started)) s"

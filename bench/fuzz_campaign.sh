#!/usr/bin/env bash
# The long fuzz runs: every libFuzzer target (fuzz/) for RUNS executions (default 1,000,000) over
# its seed corpus and what earlier runs found (build-fuzz/corpus/), JOBS targets at a time (default
# 2), ASan + UBSan on. Prints a markdown table row per target (executions, seconds, exec/s, edge
# coverage, features, corpus, peak RSS, findings) for bench/RESULTS.md; fails if any target
# found something (its input is in build-fuzz/findings/).
#   bench/fuzz_campaign.sh [RUNS] [JOBS]
#   bench/fuzz_campaign.sh --report      (the table of the last runs only)
set -uo pipefail
cd "$(dirname "$0")/.."
report_only=false
[ "${1:-}" = "--report" ] && { report_only=true; shift; }
runs=${1:-1000000}
jobs=${2:-2}
[ -x build-fuzz/bin/fuzz_pipeline ] || scripts/build-sanitized.sh
targets=(fuzz_pipeline fuzz_model_config fuzz_safetensors fuzz_tokenizer fuzz_jsonl fuzz_peft_adapter fuzz_run_state)
logs=build-fuzz/campaign
mkdir -p "$logs" build-fuzz/findings
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
run_one() {
  local t=$1 start end
  mkdir -p "build-fuzz/corpus/$t"
  start=$(date +%s)
  build-fuzz/bin/"$t" -runs="$runs" -timeout=10 -max_len=1048576 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="build-fuzz/findings/$t-" "build-fuzz/corpus/$t" "fuzz/corpus/$t" >"$logs/$t.log" 2>&1
  echo "$? $(( $(date +%s) - start ))" >"$logs/$t.status"
}
if ! $report_only; then
  for t in "${targets[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 5; done
    run_one "$t" &
  done
  wait
fi
failed=0
echo "| target | executions | seconds | exec/s | edges (cov) | features | corpus files | peak RSS MiB | findings |"
echo "|---|---|---|---|---|---|---|---|---|"
for t in "${targets[@]}"; do
  read -r rc seconds <"$logs/$t.status"
  done_line=$(grep -E "^#[0-9]+[[:space:]]+DONE" "$logs/$t.log" | tail -1)
  execs=$(grep -oE "stat::number_of_executed_units: [0-9]+" "$logs/$t.log" | awk '{print $2}')
  rss=$(grep -oE "stat::peak_rss_mb: +[0-9]+" "$logs/$t.log" | awk '{print $2}')
  cov=$(echo "$done_line" | grep -oE "cov: [0-9]+" | awk '{print $2}')
  ft=$(echo "$done_line" | grep -oE "ft: [0-9]+" | awk '{print $2}')
  corpus=$(ls "build-fuzz/corpus/$t" | wc -l)
  findings=none
  if [ "$rc" -ne 0 ]; then findings="exit $rc, see $logs/$t.log"; failed=1; fi
  echo "| $t | ${execs:-?} | $seconds | $(( ${execs:-0} / (seconds > 0 ? seconds : 1) )) | ${cov:-?} | ${ft:-?} | $corpus | ${rss:-?} | $findings |"
done
exit $failed

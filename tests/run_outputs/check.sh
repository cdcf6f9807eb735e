#!/usr/bin/env bash
# What a run leaves for people to look at, read by other programs than loom:
#   check.sh run    LOOM WORK  a short quickstart run into WORK/run (the fixture of the two below)
#   check.sh events LOOM WORK  its TensorBoard events read by read_events.py (protobuf, crcmod)
#   check.sh page   LOOM WORK  `loom report`'s page opened by headless Chromium: the DOM after its
#                              script ran, checked by check_page.py, and a screenshot (WORK/page.png)
# Without a Chromium the page check is skipped (exit 77) unless LOOM_REQUIRE_BROWSER=1, as CI's
# browser stage sets it (scripts/test-browser.sh installs Chromium).
set -euo pipefail
mode=$1 loom=$2 work=$3
here=$(cd "$(dirname "$0")" && pwd)
run=$work/run

case $mode in
run)
  rm -rf "$work" && mkdir -p "$work"
  if ! "$loom" run "$here/../../configs/quickstart.toml" --output "$run" --set train.max_steps=30 --set train.log_every=5 \
      --set train.eval_every=15 --set train.checkpoint_every=0 >"$work/run.log" 2>&1; then
    cat "$work/run.log"
    exit 1
  fi
  for line in "events:    $run/events.out.tfevents.loom" "report:    $run/report.html"; do
    grep -qF "$line" "$work/run.log" || { cat "$work/run.log"; echo "check.sh: the run did not print '$line'" >&2; exit 1; }
  done
  ;;
events)
  # Debian's python3 carries python3-protobuf and python3-crcmod; another python3 first on PATH may not.
  for python in python3 /usr/bin/python3; do
    if "$python" -c 'import google.protobuf, crcmod' 2>/dev/null; then
      exec "$python" "$here/read_events.py" "$run"
    fi
  done
  echo "check.sh: python3-protobuf and python3-crcmod are needed (scripts/setup-debian.sh --tests installs them)" >&2
  exit 1
  ;;
page)
  browser=
  for b in chromium-headless-shell chromium chromium-browser google-chrome; do
    if command -v "$b" >/dev/null 2>&1; then browser=$b; break; fi
  done
  if [ -z "$browser" ]; then
    echo "check.sh: no Chromium here; the page is checked in CI's browser stage (scripts/test-browser.sh)"
    [ "${LOOM_REQUIRE_BROWSER:-0}" = 1 ] && exit 1
    exit 77
  fi
  "$loom" report "$run" --output "$work/page.html"
  flags=(--headless --no-sandbox --disable-gpu --no-first-run --user-data-dir="$work/browser-profile" --window-size=1300,1800)
  timeout 120 "$browser" "${flags[@]}" --dump-dom "file://$work/page.html" >"$work/page.dom" 2>"$work/browser.log" || { cat "$work/browser.log"; exit 1; }
  timeout 120 "$browser" "${flags[@]}" --screenshot="$work/page.png" "file://$work/page.html" >>"$work/browser.log" 2>&1 || { cat "$work/browser.log"; exit 1; }
  exec python3 "$here/check_page.py" "$run" "$work/page.dom" "$work/page.png"
  ;;
*)
  echo "check.sh: run, events or page" >&2
  exit 2
  ;;
esac

#!/usr/bin/env bash
# scripts/check-abi.sh's comparison on a stand-in for the public headers (layout.cpp), built as
# each kind of release would change it: a struct grown inside a minor, or a virtual added to an
# interface, is refused against an older minor, naming it; an added struct passes against an older
# minor and is refused within the same one; the SDK's and the kit's parts are held apart. Without abidiff (abigail-tools): skipped (77).
#   tests/abi/refuses_changes.sh WORK_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
work=${1:?work folder}
command -v abidw >/dev/null || { echo "refuses_changes.sh: abigail-tools is not installed"; exit 77; }
rm -rf "$work" && mkdir -p "$work"
build() {  # NAME DEFINES...
  local name=$1
  shift
  c++ -std=c++17 -g -O0 -fno-eliminate-unused-debug-types -femit-class-debug-always -fPIC -shared "$@" "$here/layout.cpp" -o "$work/$name.so"
  abidw --no-show-locs --no-corpus-path --no-comp-dir-path --load-all-types "$work/$name.so" >"$work/$name.abi"
}
build base
build kit_grown -DKIT_GROWN
build kit_added -DKIT_ADDED
build sdk_grown -DSDK_GROWN
build sdk_virtual -DSDK_VIRTUAL
compare() { "$root/scripts/check-abi.sh" --compare "$work/base.abi" "$work/$1.abi" "$2" "$3" >"$work/$1-$2-$3.txt" 2>&1; }
expect() {  # WANTED_STATUS NAME PART RULE [TEXT]
  local status=0
  compare "$2" "$3" "$4" || status=$?
  if [ "$status" -ne "$1" ]; then
    cat "$work/$2-$3-$4.txt"
    echo "refuses_changes.sh: $2 against the $4 $3 minor: status $status, expected $1" >&2
    exit 1
  fi
  if [ -n "${5:-}" ] && ! grep -qF "$5" "$work/$2-$3-$4.txt"; then
    cat "$work/$2-$3-$4.txt"
    echo "refuses_changes.sh: $2 against the $4 $3 minor: the report does not say \"$5\"" >&2
    exit 1
  fi
}
expect 0 base kit same
expect 0 base sdk same
expect 1 kit_grown kit older "'struct loom::kit::DecoderConfig' changed"
expect 1 kit_grown kit older "type size changed from 320 to 384 (in bits)"
expect 0 kit_grown sdk older  # the kit's change is not the SDK's
expect 0 kit_added kit older
expect 1 kit_added kit same "'struct loom::kit::RouterSettings'"
expect 1 sdk_grown sdk older "'struct loom::Batch' changed"
expect 0 sdk_grown kit older  # the SDK's change is not the kit's
expect 1 sdk_virtual sdk older "'method virtual int loom::Collator::split(int)', virtual at voffset 3/3"
expect 0 sdk_virtual kit older  # nor is this the kit's
echo "refuses_changes.sh: every change refused or kept as the rules say"

#!/usr/bin/env bash
# Holds the SDK's and the kit's ABI to what every recorded minor of their major promised (abi/),
# with libabigail's abidw and abidiff (Debian's abigail-tools):
# - symbols: the shared libraries' exported functions and variables (libloom_sdk, libloom_kit);
# - layouts: every struct, class and enum of the public headers, as the ABI probe records them
#   (abi/probe.cpp, built with full debug information into BUILD/abi/libloom_abi_probe.so).
# Against the recorded ABI of the current minor nothing may change, not even an addition (a plugin
# built against the new headers would run on an older loom of the same version); against an older
# minor of the same major, additions only: nothing removed, no layout changed. The kit's minors
# before LOOM_KIT_LAYOUT_MINOR are not held (the host refuses their plugins at load,
# loom/kit/version.hpp); the SDK breaks only in a new major.
#   scripts/check-abi.sh BUILD_DIR                  check the build against abi/
#   scripts/check-abi.sh BUILD_DIR --record [--force] record the current versions' ABI into abi/
#   scripts/check-abi.sh --record-from REV          record the layouts of git revision REV's headers
#                                                   (types only: its libraries are not built), as
#                                                   abi/types-sdk-*-kit-*.abi.xz of its versions
#   scripts/check-abi.sh --compare BASELINE CURRENT sdk|kit same|older
#                                                   one comparison (abidw XML, .xz or not, or a
#                                                   library), as the check makes it (tests/abi/)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v abidiff >/dev/null || { echo "check-abi.sh: abidiff is needed (Debian's abigail-tools); skipped"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# One comparison's verdict: prints what changed and returns 1 where the rule forbids it.
compare() {
  local baseline=$1 current=$2 part=$3 rule=$4
  case "$baseline" in *.xz) xz -dc "$baseline" >"$work/baseline.abi"; baseline=$work/baseline.abi ;; esac
  case "$current" in *.xz) xz -dc "$current" >"$work/current.abi"; current=$work/current.abi ;; esac
  local report status=0 counted="summary:" suppressions=(--suppressions "abi/$part.suppr")
  # A probe's types count, and the classes its loom_abi_reach_* functions reach (their virtuals):
  # its other functions are LibTorch's inline templates, its variables none of loom's.
  if grep -q "loom_abi_probe" "$baseline"; then
    counted="functions changes summary:|unreachable types summary:"
    suppressions+=(--suppressions abi/probe.suppr)
  fi
  report=$(abidiff --non-reachable-types --no-default-suppression "${suppressions[@]}" "$baseline" "$current") || status=$?
  if [ $((status & 3)) -ne 0 ]; then  # 1: abidiff's own error, 2: its usage
    printf '%s\n' "$report" >&2
    echo "check-abi.sh: abidiff could not compare $baseline with $current (status $status)" >&2
    return 2
  fi
  # The summaries' counts: "N Removed, M Changed (K filtered out), L Added ..." on every line.
  local counts
  counts=$(printf '%s\n' "$report" | awk -v counted="$counted" 'tolower($0) ~ counted {
      line = tolower($0); gsub(/\([^)]*\)/, "", line)
      if (match(line, /[0-9]+ removed/)) removed += substr(line, RSTART, RLENGTH) + 0
      if (match(line, /[0-9]+ changed/)) changed += substr(line, RSTART, RLENGTH) + 0
      if (match(line, /[0-9]+ added/)) added += substr(line, RSTART, RLENGTH) + 0
    } END { print removed + 0, changed + 0, added + 0 }')
  local removed changed added
  read -r removed changed added <<<"$counts"
  if [ "$removed" -eq 0 ] && [ "$changed" -eq 0 ] && { [ "$rule" = older ] || [ "$added" -eq 0 ]; }; then
    return 0
  fi
  printf '%s\n' "$report"
  return 1
}

dump=(abidw --no-show-locs --no-corpus-path --no-comp-dir-path)
version() { sed -n "s/^#define $1 \([0-9]*\)$/\1/p" "$2"; }

# The ABI probe of the headers under ROOT (sdk/include, kit/include) into OUT.abi: every public
# header in one translation unit (abi/probe.cpp for this tree's; Registry.AbiProbeIncludesEveryPublicHeader
# keeps it whole), compiled with full debug information, every type kept and described whole
# (GCC describes a class with a vtable only where its key function is defined, otherwise), read
# with all its types. LibTorch's headers where Debian puts them, or LOOM_ABI_INCLUDES.
probe() {
  local root=$1 source=$2 out=$3
  c++ -std=c++17 -g -O0 -fno-eliminate-unused-debug-types -femit-class-debug-always -fPIC -shared -D_GLIBCXX_USE_CXX11_ABI=1 -DBOOST_DLL_USE_STD_FS \
    -I"$root/sdk/include" -I"$root/kit/include" ${LOOM_ABI_INCLUDES:--isystem /usr/include/torch/csrc/api/include} "$source" -o "$out.so"
  "${dump[@]}" --load-all-types "$out.so" >"$out.abi"
}

if [ "${1:-}" = --record-from ]; then
  rev=${2:?usage: check-abi.sh --record-from REV}
  git archive "$rev" sdk/include kit/include | tar x -C "$work"
  {
    for h in "$work"/sdk/include/loom/*.hpp; do echo "#include \"loom/${h##*/}\""; done
    for h in "$work"/kit/include/loom/kit/*.hpp; do echo "#include \"loom/kit/${h##*/}\""; done
    echo 'extern "C" __attribute__((visibility("default"))) int loom_abi_probe() { return 0; }'
  } >"$work/probe.cpp"
  probe "$work" "$work/probe.cpp" "$work/probe"
  # Then each class with virtuals reached, as abi/probe.cpp reaches them.
  python3 scripts/abi_classes.py "$work/probe.abi" | while read -r class; do
    echo "extern \"C\" __attribute__((visibility(\"default\"))) void loom_abi_reach_${class//::/_}(const $class*) {}"
  done >>"$work/probe.cpp"
  probe "$work" "$work/probe.cpp" "$work/probe"
  sdk=$(version LOOM_SDK_VERSION_MAJOR "$work/sdk/include/loom/version.hpp").$(version LOOM_SDK_VERSION_MINOR "$work/sdk/include/loom/version.hpp")
  kit=$(version LOOM_KIT_VERSION_MAJOR "$work/kit/include/loom/kit/version.hpp").$(version LOOM_KIT_VERSION_MINOR "$work/kit/include/loom/kit/version.hpp")
  xz -9 -T1 -c "$work/probe.abi" >"abi/types-sdk-$sdk-kit-$kit.abi.xz"
  echo "check-abi.sh: recorded the layouts of SDK $sdk and kit $kit ($rev) in abi/types-sdk-$sdk-kit-$kit.abi.xz"
  exit 0
fi

if [ "${1:-}" = --compare ]; then
  [ $# -eq 5 ] || { echo "usage: check-abi.sh --compare BASELINE CURRENT sdk|kit same|older" >&2; exit 2; }
  compare "$2" "$3" "$4" "$5"
  exit $?
fi

build=${1:?usage: check-abi.sh BUILD_DIR [--record [--force]]}
mode=${2:-check}
force=${3:-}
sdk=$(version LOOM_SDK_VERSION_MAJOR sdk/include/loom/version.hpp).$(version LOOM_SDK_VERSION_MINOR sdk/include/loom/version.hpp)
kit=$(version LOOM_KIT_VERSION_MAJOR kit/include/loom/kit/version.hpp).$(version LOOM_KIT_VERSION_MINOR kit/include/loom/kit/version.hpp)
kit_layout=$(version LOOM_KIT_LAYOUT_MINOR kit/include/loom/kit/version.hpp)
for f in "$build/lib/libloom_sdk.so" "$build/lib/libloom_kit.so"; do
  [ -f "$f" ] || { echo "check-abi.sh: no $f (build loom first: scripts/build.sh)" >&2; exit 2; }
done
probe . abi/probe.cpp "$work/types"
# Every class with virtuals reached by a loom_abi_reach_* function, so that abidiff compares them.
"${dump[@]}" "$work/types.so" >"$work/reached.abi"
unreached=$(comm -23 <(python3 scripts/abi_classes.py "$work/types.abi") <(python3 scripts/abi_classes.py "$work/reached.abi"))
if [ -n "$unreached" ]; then
  echo "check-abi.sh: abi/probe.cpp reaches no function of these classes with virtuals, whose virtuals would go unchecked; add a LOOM_ABI_REACH line for each:" >&2
  printf '  %s\n' $unreached >&2
  exit 1
fi
"${dump[@]}" "$build/lib/libloom_sdk.so" >"$work/sdk.abi"
"${dump[@]}" "$build/lib/libloom_kit.so" >"$work/kit.abi"

if [ "$mode" = --record ]; then
  for f in "abi/sdk-$sdk.abi" "abi/kit-$kit.abi" "abi/types-sdk-$sdk-kit-$kit.abi.xz"; do
    [ ! -e "$f" ] || [ "$force" = --force ] || { echo "check-abi.sh: $f is recorded already: a released ABI changes only with a new version (--force overwrites)" >&2; exit 1; }
  done
  cp "$work/sdk.abi" "abi/sdk-$sdk.abi"
  cp "$work/kit.abi" "abi/kit-$kit.abi"
  xz -9 -T1 -c "$work/types.abi" >"abi/types-sdk-$sdk-kit-$kit.abi.xz"
  echo "check-abi.sh: recorded SDK $sdk and kit $kit in abi/"
  exit 0
fi

# Which recorded minors the current versions must keep: "same", "older", or "" (not held).
rule_for() {
  local part=$1 recorded=$2 current major minor
  current=$([ "$part" = sdk ] && echo "$sdk" || echo "$kit")
  major=${recorded%%.*} minor=${recorded#*.}
  [ "$major" = "${current%%.*}" ] || return 0
  if [ "$minor" = "${current#*.}" ]; then echo same
  elif [ "$minor" -gt "${current#*.}" ]; then echo newer
  elif [ "$part" = kit ] && [ "$minor" -lt "$kit_layout" ]; then echo ""
  else echo older
  fi
}
failed=0 checked=0
check() {  # PART RECORDED_VERSION BASELINE CURRENT WHAT
  local rule
  rule=$(rule_for "$1" "$2")
  [ -n "$rule" ] || return 0
  if [ "$rule" = newer ]; then
    echo "check-abi.sh: abi/ records $1 $2, newer than the headers' $([ "$1" = sdk ] && echo "$sdk" || echo "$kit")" >&2
    failed=1
    return 0
  fi
  checked=$((checked + 1))
  if compare "$3" "$4" "$1" "$rule"; then
    echo "check-abi.sh: $1 $2's $5: kept"
  else
    [ $? -eq 1 ] || exit 2
    failed=1
    if [ "$rule" = same ]; then
      echo "check-abi.sh: the $5 of $1 $2 changed without a new minor: give the change a new minor (loom/version.hpp or loom/kit/version.hpp) and record it (scripts/check-abi.sh BUILD --record)" >&2
    elif [ "$1" = kit ]; then
      echo "check-abi.sh: the $5 of kit $2 changed (above): keep them, or raise LOOM_KIT_LAYOUT_MINOR to the new minor so that the host refuses plugins built against older ones" >&2
    else
      echo "check-abi.sh: the $5 of SDK $2 changed (above): the SDK keeps its ABI within a major (loom/version.hpp); append instead, or make a new major" >&2
    fi
  fi
}
shopt -s nullglob
for f in abi/sdk-*.abi; do v=${f#abi/sdk-}; check sdk "${v%.abi}" "$f" "$work/sdk.abi" "exported symbols"; done
for f in abi/kit-*.abi; do v=${f#abi/kit-}; check kit "${v%.abi}" "$f" "$work/kit.abi" "exported symbols"; done
for f in abi/types-sdk-*-kit-*.abi.xz; do
  v=${f#abi/types-sdk-}; v=${v%.abi.xz}
  check sdk "${v%%-kit-*}" "$f" "$work/types.abi" "layouts"
  check kit "${v##*-kit-}" "$f" "$work/types.abi" "layouts"
done
for need in "abi/sdk-$sdk.abi" "abi/kit-$kit.abi" "abi/types-sdk-$sdk-kit-$kit.abi.xz"; do
  [ -f "$need" ] || { echo "check-abi.sh: no $need: record the current versions' ABI (scripts/check-abi.sh BUILD --record) once the change is final" >&2; failed=1; }
done
[ "$failed" -eq 0 ] || exit 1
echo "check-abi.sh: SDK $sdk and kit $kit keep every recorded ABI they must ($checked comparisons)"

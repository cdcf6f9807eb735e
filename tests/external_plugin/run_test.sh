#!/usr/bin/env bash
# Installs loom from BUILD_DIR into a prefix, builds tests/external_plugin against it with
# find_package(Loom), and checks that the installed loom loads and uses the plugin.
set -euo pipefail
build_dir=$1
work=$2
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build_dir" --prefix "$work/prefix" >"$work/install.log"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$here" -B "$work/build" "${generator[@]}" -DCMAKE_PREFIX_PATH="$work/prefix;${CMAKE_PREFIX_PATH:-}" >"$work/configure.log" ||
  { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" >"$work/build.log" || { cat "$work/build.log"; exit 1; }
# The package's version is the SDK's: asking for a newer minor than the installed one fails.
if cmake -S "$here" -B "$work/build-newer" "${generator[@]}" -DCMAKE_PREFIX_PATH="$work/prefix;${CMAKE_PREFIX_PATH:-}" -DLOOM_SDK_WANTED=2.99 \
  >"$work/configure-newer.log" 2>&1; then
  echo "FAIL: find_package(Loom 2.99) found the installed SDK"; exit 1
fi
grep -q 'version: 2\.[0-9]' "$work/configure-newer.log" || { cat "$work/configure-newer.log"; echo "FAIL: no version in the refusal"; exit 1; }

loom="$work/prefix/bin/loom"
fail() { echo "FAIL: $*"; exit 1; }

# The installed binary finds its built-in plugins in ../lib/loom/plugins.
"$loom" plugins | grep -q '^llama ' || fail "installed loom does not list its built-in plugins"

export LOOM_PLUGIN_PATH="$work/build/plugins"
listing=$("$loom" plugins)
echo "$listing" | grep -Eq '^last-device +placement +1\.2\.3 +2\.[0-9]+ ' || fail "plugin not listed: $listing"
"$loom" plugins describe last-device | grep -q 'prefer' || fail "describe does not show the plugin's option"

cat >"$work/pipeline.toml" <<'TOML'
[model]
plugin = "llama"
init = "random"
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
vocab_size = 300

[placement]
plugin = "last-device"
TOML
plan=$("$loom" plan "$work/pipeline.toml" --devices "cpu=4GiB,cuda:0=2GiB" --json)
echo "$plan" | grep -q '"strategy": "last-device"' || fail "plan not made by the plugin: $plan"
[ "$(echo "$plan" | grep -c '"device": "cuda:0"')" -ge 5 ] || fail "blocks not on cuda:0: $plan"

# A bad option value reaches the plugin's factory and comes back as a positioned error.
set +e
out=$("$loom" plan "$work/pipeline.toml" --devices "cpu=4GiB" --set placement.prefer=tpu 2>&1)
code=$?
set -e
[ $code -eq 2 ] || fail "expected exit 2, got $code: $out"
echo "$out" | grep -q 'placement plugin .last-device.: unknown device "tpu"' || fail "unexpected message: $out"
echo "external plugin: ok"

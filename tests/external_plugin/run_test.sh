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
family_source=$(cd "$here/../../plugins/models/qwen3" && pwd)/qwen3_family.cpp
cmake -S "$here" -B "$work/build" "${generator[@]}" -DCMAKE_PREFIX_PATH="$work/prefix;${CMAKE_PREFIX_PATH:-}" \
  -DLOOM_FAMILY_SOURCE="$family_source" >"$work/configure.log" ||
  { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" >"$work/build.log" || { cat "$work/build.log"; exit 1; }
# The package's version is the SDK's: asking for a newer minor than the installed one fails.
major=$(sed -n 's/^#define LOOM_SDK_VERSION_MAJOR //p' "$work/prefix/include/loom/version.hpp")
if cmake -S "$here" -B "$work/build-newer" "${generator[@]}" -DCMAKE_PREFIX_PATH="$work/prefix;${CMAKE_PREFIX_PATH:-}" -DLOOM_SDK_WANTED="$major.99" \
  >"$work/configure-newer.log" 2>&1; then
  echo "FAIL: find_package(Loom $major.99) found the installed SDK"; exit 1
fi
grep -q "version: $major\.[0-9]" "$work/configure-newer.log" || { cat "$work/configure-newer.log"; echo "FAIL: no version in the refusal"; exit 1; }

loom="$work/prefix/bin/loom"
fail() { echo "FAIL: $*"; exit 1; }

# The installed binary finds its built-in plugins in ../lib/loom/plugins.
"$loom" plugins | grep -q '^llama ' || fail "installed loom does not list its built-in plugins"

export LOOM_PLUGIN_PATH="$work/build/plugins"
listing=$("$loom" plugins)
echo "$listing" | grep -Eq "^last-device +placement +1\.2\.3 +$major\.[0-9]+ " || fail "plugin not listed: $listing"
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

# The qwen3 family, built out of tree against the installed SDK and kit, loads in place of the
# installed one and trains: the loss falls and the saved model is Qwen3's, q/k norms included.
rm "$work/prefix/lib/loom/plugins/loom_model_qwen3.so"
export LOOM_PLUGIN_PATH="$work/build/families"
"$loom" plugins | grep -Eq '^qwen3 +model ' || fail "the out-of-tree qwen3 family is not listed: $("$loom" plugins)"
mkdir -p "$work/train"
for i in $(seq 1 48); do echo "{\"q\": \"w$((i % 12))x$((i % 7))\", \"a\": \"w$((i % 12))x$((i % 7))\"}"; done >"$work/train/train.jsonl"
cat >"$work/train/pipeline.toml" <<'TOML'
[model]
plugin = "qwen3"
init = "random"
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
vocab_size = 259
[tokenizer]
plugin = "bytes"
padding_side = "left"
pad_token = "eos"
[data]
train = "train.jsonl"
format = "Q:{q} A:{a}"
max_length = 32
[collator]
plugin = "completion-only"
response_template = " A:"
[placement]
plugin = "single"
[train]
batch_size = 8
max_steps = 30
lr = 3e-3
log_every = 1
TOML
"$loom" run "$work/train/pipeline.toml" --output "$work/train/out" >"$work/train/run.log" 2>&1 || { cat "$work/train/run.log"; fail "training the out-of-tree qwen3 family"; }
grep -q 'Qwen3ForCausalLM' "$work/train/out/model/config.json" || fail "the saved model is not Qwen3's: $(cat "$work/train/out/model/config.json")"
grep -aq 'self_attn.k_norm.weight' "$work/train/out/model/model.safetensors" || fail "the saved Qwen3 model has no k_norm"
python3 - "$work/train/out/metrics.jsonl" <<'PY' || fail "the loss did not fall: $(head -c 2000 "$work/train/out/metrics.jsonl")"
import json, sys
losses = [r["loss"] for r in map(json.loads, open(sys.argv[1])) if "loss" in r and r.get("split", "train") == "train"]
sys.exit(0 if len(losses) >= 20 and sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5 else 1)
PY
echo "external plugin: ok"

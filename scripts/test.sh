#!/usr/bin/env bash
# Sets up (Debian packages), builds loom with its tests, and runs them all.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-debian.sh --tests
scripts/build.sh -DLOOM_BUILD_TESTS=ON
ctest --test-dir build --output-on-failure -j 2

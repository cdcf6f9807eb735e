#!/usr/bin/env bash
# Sets up, builds loom, and runs the quickstart pipeline: validate, then plan.
# (Training arrives with the training slice; until then `loom run --dry-run` stops before it.)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-debian.sh
scripts/build.sh -DLOOM_BUILD_TESTS=OFF
build/bin/loom validate configs/quickstart.toml
build/bin/loom plan configs/quickstart.toml

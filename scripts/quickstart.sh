#!/usr/bin/env bash
# Sets up, builds loom, and runs the quickstart pipeline: LoRA on a small Llama-shaped model that
# learns two-digit addition on the CPU (about 4 minutes on 2 cores), then reports the held-out
# exact-match and writes a PEFT adapter. Each run goes to a fresh folder under runs/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-debian.sh
scripts/build.sh -DLOOM_BUILD_TESTS=OFF
build/bin/loom validate configs/quickstart.toml
build/bin/loom run configs/quickstart.toml --output "runs/quickstart-$(date +%Y%m%d-%H%M%S)"

#!/usr/bin/env bash
# Regenerates the reference part of docs/pipeline.md (everything after the marker line) from the
# schemas of the built loom and its plugins. A test fails when the file falls behind.
set -euo pipefail
cd "$(dirname "$0")/.."
marker='test fails when this part falls behind.'
head=$(sed "/$marker/q" docs/pipeline.md)
{ printf '%s\n\n' "$head"; build/bin/loom plugins reference; } > docs/pipeline.md.new
mv docs/pipeline.md.new docs/pipeline.md

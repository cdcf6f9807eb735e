#!/usr/bin/env bash
# CI's browser stage (.ci/run, after scripts/test.sh, whose build it uses): installs Debian's
# headless Chromium, kept out of the test command for its budget, and runs the tests that need it
# (`loom report`'s page opened and checked from its DOM, tests/run_outputs/check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
if ! command -v chromium-headless-shell >/dev/null 2>&1 && ! command -v chromium >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || { echo "test-browser.sh: run as root to install chromium-headless-shell, or install it first" >&2; exit 1; }
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends chromium-headless-shell >/dev/null
fi
LOOM_REQUIRE_BROWSER=1 ctest --test-dir build --output-on-failure -R '^(run_outputs_fixture|run_page_in_chromium)$'
echo "test-browser.sh: $((SECONDS - started)) s (the screenshot: build/tests/run_outputs/page.png)"

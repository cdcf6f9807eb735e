#!/usr/bin/env bash
# Holds the committed chat-template references to their references: tests/fixtures/chat/
# references.jsonl must be what Python's jinja2 renders in transformers' environment
# (render_references.py) and what @huggingface/jinja renders (render_references.mjs), and
# jinja_cases.jsonl what jinja2 renders of jinja_cases.py. ChatTemplates.* hold loom to the files.
#   tests/chat/check_references.sh TEST_DATA_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
fixtures=$here/../fixtures/chat
npm=$1/npm
python3 -c 'import jinja2' 2>/dev/null || { echo "check_references.sh: python3-jinja2 is needed (scripts/setup-debian.sh --tests installs it)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
python3 "$here/render_references.py" "$npm" >"$work/jinja2.jsonl"
cmp -s "$work/jinja2.jsonl" "$fixtures/references.jsonl" || { echo "references.jsonl differs from what jinja2 renders now:"; diff "$fixtures/references.jsonl" "$work/jinja2.jsonl" | head -20; status=1; }
python3 "$here/jinja_cases.py" >"$work/cases.jsonl"
cmp -s "$work/cases.jsonl" "$fixtures/jinja_cases.jsonl" || { echo "jinja_cases.jsonl differs from what jinja2 renders now:"; diff "$fixtures/jinja_cases.jsonl" "$work/cases.jsonl" | head -20; status=1; }
# The second reference renders the same cases; its error messages are its own, so texts are
# compared, and where one refused, the other must have refused too.
python3 "$here/render_references.py" --cases "$npm" | node "$here/render_references.mjs" "$npm" >"$work/hf-jinja.jsonl"
python3 - "$work/jinja2.jsonl" "$work/hf-jinja.jsonl" <<'PY' || status=1
import json, sys
first = [json.loads(l) for l in open(sys.argv[1], encoding="utf-8")]
second = {c["case"]: c for c in (json.loads(l) for l in open(sys.argv[2], encoding="utf-8"))}
bad = [c["case"] for c in first if c["case"] not in second or ("error" in c) != ("error" in second[c["case"]]) or c.get("text") != second[c["case"]].get("text")]
for case in bad[:20]:
    print("@huggingface/jinja renders otherwise:", case)
print(f"check_references.sh: {len(first) - len(bad)} of {len(first)} cases the same in jinja2 and @huggingface/jinja")
sys.exit(1 if bad else 0)
PY
exit "$status"

// The second reference: @huggingface/jinja (HF's JavaScript Jinja, as transformers.js renders chat
// templates) over the same cases as render_references.py, printed in the same JSON-lines form.
// The cases (templates, special tokens, contexts) come from render_references.py --cases, so both
// references render exactly the same inputs.
//   python3 tests/chat/render_references.py --cases NPM_DIR | node tests/chat/render_references.mjs NPM_DIR
import { createInterface } from "node:readline";
import { pathToFileURL } from "node:url";
import { join } from "node:path";

const npmDir = process.argv[2];
const { Template } = await import(pathToFileURL(join(npmDir, "huggingface-jinja-0.5.13/package/dist/index.js")).href);

const compiled = new Map();
for await (const line of createInterface({ input: process.stdin })) {
  if (!line) continue;
  const { case: name, template, context } = JSON.parse(line);
  const out = { case: name };
  try {
    if (!compiled.has(template)) compiled.set(template, new Template(template));
    out.text = compiled.get(template).render(context);  // it defines raise_exception itself
  } catch (e) {
    out.error = String(e.message ?? e);
  }
  process.stdout.write(JSON.stringify(out) + "\n");
}

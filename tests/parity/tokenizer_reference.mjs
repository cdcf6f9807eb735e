// The reference side of the tokenizer parity test: HF's own JS implementation
// (@huggingface/tokenizers) encodes each line of a corpus, one JSON array of ids per line.
//   node tokenizer_reference.mjs LIB_DIR MODEL_DIR CORPUS.jsonl (special|no-special)
// LIB_DIR holds the unpacked @huggingface/tokenizers package; MODEL_DIR tokenizer.json and
// tokenizer_config.json. Corpus lines are JSON strings.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [libDir, modelDir, corpusFile, mode] = process.argv.slice(2);
if (!libDir || !modelDir || !corpusFile || !["special", "no-special"].includes(mode)) {
  console.error("usage: node tokenizer_reference.mjs LIB_DIR MODEL_DIR CORPUS.jsonl (special|no-special)");
  process.exit(2);
}
const { Tokenizer } = await import(pathToFileURL(join(libDir, "dist", "tokenizers.mjs")).href);
const tokenizerJson = JSON.parse(readFileSync(join(modelDir, "tokenizer.json"), "utf8"));
const tokenizerConfig = JSON.parse(readFileSync(join(modelDir, "tokenizer_config.json"), "utf8"));
const tokenizer = new Tokenizer(tokenizerJson, tokenizerConfig);
const out = [];
for (const line of readFileSync(corpusFile, "utf8").split("\n")) {
  if (line === "") continue;
  const text = JSON.parse(line);
  out.push(JSON.stringify(tokenizer.encode(text, { add_special_tokens: mode === "special" }).ids));
}
process.stdout.write(out.join("\n") + "\n");

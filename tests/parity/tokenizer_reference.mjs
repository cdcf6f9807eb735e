// The reference side of the tokenizer parity test: HF's own JS implementation
// (@huggingface/tokenizers) encodes each line of a corpus, one JSON array of ids per line.
//   node tokenizer_reference.mjs LIB_DIR MODEL_DIR INPUT.jsonl (special|no-special|decode)
// LIB_DIR holds the unpacked @huggingface/tokenizers package; MODEL_DIR tokenizer.json and
// tokenizer_config.json. Input lines are JSON strings to encode, or for `decode` JSON arrays of ids
// whose text is printed as a JSON string (no clean-up of spaces, special tokens kept).
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [libDir, modelDir, corpusFile, mode] = process.argv.slice(2);
if (!libDir || !modelDir || !corpusFile || !["special", "no-special", "decode"].includes(mode)) {
  console.error("usage: node tokenizer_reference.mjs LIB_DIR MODEL_DIR INPUT.jsonl (special|no-special|decode)");
  process.exit(2);
}
const { Tokenizer } = await import(pathToFileURL(join(libDir, "dist", "tokenizers.mjs")).href);
const tokenizerJson = JSON.parse(readFileSync(join(modelDir, "tokenizer.json"), "utf8"));
const tokenizerConfig = JSON.parse(readFileSync(join(modelDir, "tokenizer_config.json"), "utf8"));
const tokenizer = new Tokenizer(tokenizerJson, tokenizerConfig);
const out = [];
for (const line of readFileSync(corpusFile, "utf8").split("\n")) {
  if (line === "") continue;
  const input = JSON.parse(line);
  if (mode === "decode") {
    // decode() refuses an empty list; its text is empty.
    out.push(JSON.stringify(input.length ? tokenizer.decode(input, { clean_up_tokenization_spaces: false }) : ""));
  } else {
    out.push(JSON.stringify(tokenizer.encode(input, { add_special_tokens: mode === "special" }).ids));
  }
}
process.stdout.write(out.join("\n") + "\n");

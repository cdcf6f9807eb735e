// The reference side of the tokenizer parity test: HF's own JS implementation
// (@huggingface/tokenizers), loading the tokenizer once for every pass.
//   node tokenizer_reference.mjs LIB_DIR MODEL_DIR CORPUS.jsonl IDS.jsonl
// LIB_DIR holds the unpacked @huggingface/tokenizers package; MODEL_DIR tokenizer.json and
// tokenizer_config.json. CORPUS lines are JSON strings to encode; IDS lines JSON arrays of ids to
// decode. Prints one JSON object: "special" and "no_special", the ids of every corpus line with and
// without special tokens, and "decoded", the text of every IDS line (no clean-up of spaces,
// special tokens kept).
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [libDir, modelDir, corpusFile, idsFile] = process.argv.slice(2);
if (!libDir || !modelDir || !corpusFile || !idsFile) {
  console.error("usage: node tokenizer_reference.mjs LIB_DIR MODEL_DIR CORPUS.jsonl IDS.jsonl");
  process.exit(2);
}
const { Tokenizer } = await import(pathToFileURL(join(libDir, "dist", "tokenizers.mjs")).href);
const tokenizerJson = JSON.parse(readFileSync(join(modelDir, "tokenizer.json"), "utf8"));
const tokenizerConfig = JSON.parse(readFileSync(join(modelDir, "tokenizer_config.json"), "utf8"));
const tokenizer = new Tokenizer(tokenizerJson, tokenizerConfig);
const lines = (file) => readFileSync(file, "utf8").split("\n").filter((line) => line !== "").map((line) => JSON.parse(line));
const corpus = lines(corpusFile);
const out = {
  special: corpus.map((text) => tokenizer.encode(text, { add_special_tokens: true }).ids),
  no_special: corpus.map((text) => tokenizer.encode(text, { add_special_tokens: false }).ids),
  // decode() refuses an empty list; its text is empty.
  decoded: lines(idsFile).map((ids) => (ids.length ? tokenizer.decode(ids, { clean_up_tokenization_spaces: false }) : "")),
};
process.stdout.write(JSON.stringify(out) + "\n");
